#!/usr/bin/env bash
# The GPU checks on a CUDA machine that reaches no package registry (this workplace's lent H200): the
# machine's own python3 and torch, our missing dependencies as wheels carried in $WHEELS (`make gpu-wheels`
# downloads them here), and SmolLM2-135M's shape with random weights built there from a carried config and
# tokenizer ($MODEL_SPEC, also written by `make gpu-wheels`; the GGUF is too big to carry). Then the GPU tests
# (tests/gpu/) and `engine bench serve` at c=1/16/64/256. vLLM cannot be installed without a registry (its
# wheel alone is several times what may be carried), so unlike deploy/gpu-check.sh there is no peer here:
# the table gives ours per concurrency. Each stage has a time limit so that the whole stays under 9 minutes;
# everything it writes goes under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-results/$(date +%Y%m%d-%H%M%S)}"
WHEELS="${WHEELS:-.whl}"
MODEL_SPEC="${MODEL_SPEC:-.whl/smollm2-spec}"
mkdir -p "$OUT"
log() { echo "[gpu-check $(date +%H:%M:%S)] $*" | tee -a "$OUT/steps.log"; }
healthy() {  # PORT PID: wait for /health 200, at most 2.5 minutes (FlashInfer compiles at first use)
  for _ in $(seq 75); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" \
      2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { log "the server exited before it was healthy (see serve.log)"; return 1; }
    sleep 2
  done
  log "the server was not healthy within 2.5 minutes"; return 1
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
log "wheels from $WHEELS into /tmp/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1 || { log "wheels did not install (pip.log)"; exit 1; }
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 MAX_JOBS=16
FLASHINFER_CUDA_ARCH_LIST="$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(); \
print(f'{a}.{b}' + ('a' if a >= 9 else ''))")"
export FLASHINFER_CUDA_ARCH_LIST
python3 -c "import torch, flashinfer; print('torch', torch.__version__, torch.cuda.get_device_name(), \
'flashinfer', flashinfer.__version__, 'arch', '$FLASHINFER_CUDA_ARCH_LIST')" 2>&1 | tee "$OUT/versions.txt"

log "GPU tests, head size 64 first (the kernels the benchmark's model uses)"
timeout 280 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu -k "not 128" --timeout 200 \
  --durations=0 >"$OUT/gpu-tests-64.txt" 2>&1
log "head size 64: exit $? ($(tail -1 "$OUT/gpu-tests-64.txt"))"

log "model: SmolLM2-135M's shape, random bf16 weights"
python3 -m benchmarks.random_checkpoint "$MODEL_SPEC" /tmp/smollm2-random >>"$OUT/steps.log" 2>&1
log "ours: engine serve on :8100"
python3 -m frontend.cli.main serve /tmp/smollm2-random --device cuda --dtype bfloat16 --port 8100 \
  --served-model-name smollm2 --max-num-seqs 256 >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
if healthy 8100 $SERVER; then
  for c in 1 16 64 256; do
    left=$((520 - SECONDS)); [ "$left" -gt 60 ] && left=60
    [ "$left" -gt 10 ] || { log "bench c=$c: skipped, out of time"; continue; }
    timeout "$left" python3 -m frontend.cli.main bench serve --base-url http://127.0.0.1:8100 --model smollm2 \
      --dataset random --input-len 256 --output-len 128 --num-prompts $((c * 2 > 16 ? c * 2 : 16)) \
      --max-concurrency "$c" --ignore-eos --output-json "$OUT/bench-c$c.json" --quiet >>"$OUT/bench.log" 2>&1
    log "bench c=$c: exit $?"
  done
fi
kill $SERVER 2>/dev/null; timeout 20 tail --pid=$SERVER -f /dev/null
python3 - "$OUT" <<'PY' | tee "$OUT/bench.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| c | out tok/s | TTFT p50 ms | TPOT p50 ms |\n|---|---|---|---|")
for c in (1, 16, 64, 256):
    p = out / f"bench-c{c}.json"
    if p.exists():
        s = json.loads(p.read_text())["summary"]
        print(f"| {c} | {s['output_throughput']:.1f} | {1000 * s['ttft_s']['p50']:.1f} | {1000 * s['tpot_s']['p50']:.2f} |")
    else:
        print(f"| {c} | missing | | |")
PY
left=$((540 - SECONDS))
log "GPU tests, head size 128 (${left} s left)"
[ "$left" -gt 30 ] && timeout "$left" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu -k 128 --timeout 90 \
  >"$OUT/gpu-tests-128.txt" 2>&1
log "head size 128: exit $? ($(tail -1 "$OUT/gpu-tests-128.txt"))"
