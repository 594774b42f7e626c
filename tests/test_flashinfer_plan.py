"""The FlashInfer plan our metadata builds (worker/attention/flashinfer_meta.py), read by a torch reference
of FlashInfer's documented paged-attention semantics on CPU tensors, equals our CPU attention on the same
steps: real scheduling of a tiny model with prefill chunks, decode rows, prefix-cache hits and requests
preempted and resumed, at block sizes 16 and 64. No GPU: this is what the GPU backend plans from."""

from __future__ import annotations

import random
import sys
from collections import Counter
from typing import Any

import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.flashinfer_reference import flashinfer_reference, reference_module
from tests.test_tensor_parallel import build
from worker.attention.flashinfer_meta import decode_plan, step_plans
from worker.executor import InprocExecutor
from worker.gpu.graph_runner import DecodeGraphs
from worker.gpu.graphs import capture_sizes

VOCAB = 515


class CheckingBackend:
    """Our attention backend, with every layer's output checked against the reference of the plan."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: Counter[str] = Counter()

    def forward(self, query, key, value, kv_cache, metadata, scale, window=0, softcap=0.0):  # type: ignore[no-untyped-def]
        assert not window and not softcap  # a Llama: FlashInfer's plan has neither
        output = self.inner.forward(query, key, value, kv_cache, metadata, scale)
        decode, prefill = step_plans(metadata, kv_cache.shape[2])
        split = metadata.num_decode_tokens
        if decode is not None:
            expected = flashinfer_reference(query[:split], kv_cache, decode, scale, causal=False)
            torch.testing.assert_close(output[:split], expected, rtol=1e-5, atol=1e-5)
            self.seen["decode rows"] += decode.batch_size
        if prefill is not None:
            expected = flashinfer_reference(query[split:], kv_cache, prefill, scale, causal=True)
            torch.testing.assert_close(output[split:], expected, rtol=1e-5, atol=1e-5)
            self.seen["prefill chunks"] += prefill.batch_size
            self.seen["chunks after a cached context"] += sum(c.context_len > 0 for c in metadata.prefills)
        return output

    def paged_rows(self, metadata, num_tokens, block_size):  # type: ignore[no-untyped-def]
        return None  # every layer through forward (no native stack), so every layer is checked


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-flashinfer"))
    build(folder, "llama", 8, 4)
    return folder


@pytest.mark.parametrize("block_size", [16, 64])
def test_the_plan_read_as_flashinfer_reads_it_equals_our_attention(tiny: str, block_size: int) -> None:
    rng = random.Random(block_size)
    shared = [rng.randrange(VOCAB) for _ in range(block_size + 5)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 2 * block_size))] for _ in range(5)]
    prompts += [shared + [1, 2], shared + [3]]
    # a pool too small for every request at once: requests are preempted and resume from their prefix
    max_model_len = 4 * block_size
    num_blocks = max_model_len // block_size + 2
    worker = WorkerConfig(model=tiny, dtype="float32", block_size=block_size, num_kv_blocks=num_blocks,
                          max_model_len=max_model_len, device="cpu")  # fmt: skip
    config = EngineConfig(worker=worker, max_num_batched_tokens=16 if block_size == 16 else 96)
    executor = InprocExecutor(worker)
    backend = CheckingBackend(executor.runner.backend)
    executor.runner.backend = backend
    core = EngineCore(config, executor)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i))  # fmt: skip
    while core.has_unfinished_requests():
        core.step()
    seen = backend.seen
    assert seen["decode rows"] and seen["prefill chunks"] and seen["chunks after a cached context"], seen
    assert core.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    assert core.scheduler.kv_cache.pool.num_free_blocks == num_blocks


def test_decode_plan_by_hand() -> None:
    """Two requests, page size 4: 6 tokens in pages [7, 2] (2 in the last), 4 tokens in page [5]."""
    plan = decode_plan(torch.tensor([[7, 2, 0], [5, 0, 0]]), torch.tensor([6, 4]), page_size=4)
    assert plan.kv_indptr.tolist() == [0, 2, 3]
    assert plan.kv_indices.tolist() == [7, 2, 5]
    assert plan.kv_last_page_len.tolist() == [2, 4]
    assert plan.kv_indptr.dtype == plan.kv_indices.dtype == plan.kv_last_page_len.dtype == torch.int32


class EagerGraphs(DecodeGraphs):
    """The CUDA-graph staging with each replay run eagerly over the staged buffers (what the graph captured):
    the static inputs, the padding rows, the scratch block and the graph-mode wrappers' plans are ours, only
    the capture is not (that needs a GPU: tests/gpu/)."""

    padded_steps = 0

    def replay(self, size: int) -> torch.Tensor:
        self.padded_steps += int(self.slot_block_ids[size - 1]) == self.scratch_block
        return self.forward(size)


def serve(folder: str, block_size: int, setup: Any = None) -> tuple[dict[str, list[int]], Any]:
    """Greedy tokens of a mixed workload (prefill chunks, decode batches of 1 to 7, a shared prefix, a pool
    small enough to preempt) through the real scheduler; setup(runner) swaps in the backend under test."""
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(block_size + 5)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 2 * block_size))] for _ in range(5)]
    prompts += [shared + [1, 2], shared + [3]]
    num_blocks = 6
    worker = WorkerConfig(model=folder, dtype="float32", block_size=block_size, num_kv_blocks=num_blocks,
                          max_model_len=4 * block_size, max_num_seqs=8, device="cpu")  # fmt: skip
    executor = InprocExecutor(worker)
    if setup is not None:
        setup(executor.runner)
    core = EngineCore(EngineConfig(worker=worker, max_num_seqs=8, max_num_batched_tokens=24), executor)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i))  # fmt: skip
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens[output.request_id] += output.new_token_ids
    assert core.scheduler.kv_cache.pool.num_free_blocks == num_blocks
    assert core.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    return tokens, executor.runner


@pytest.mark.parametrize("block_size", [16])
def test_flashinfer_backend_and_graph_staging_serve_the_cpu_backend_s_tokens(
    tiny: str, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our FlashInferBackend (its host-side plans, its decode/prefill split) over the reference wrappers, then
    with every decode step staged as a CUDA graph's (padded to 1, 2, 4 or 8 rows, the padding in a scratch
    block past the engine's pool): the same greedy tokens as the CPU backend."""
    monkeypatch.setitem(sys.modules, "flashinfer", reference_module())
    from worker.attention.flashinfer import FlashInferBackend

    def flashinfer(runner: Any) -> None:
        mc = runner.model_config
        runner.backend = FlashInferBackend(torch.device("cpu"), runner.dtype, mc.num_heads, mc.num_kv_heads,
                                           mc.head_dim, runner.block_size)  # fmt: skip

    def graphs(runner: Any) -> None:
        flashinfer(runner)
        scratch = runner.num_kv_blocks  # one block past the engine's pool, as a CUDA worker allocates it
        runner.kv_caches = [torch.cat([cache, torch.zeros_like(cache[:1])]) for cache in runner.kv_caches]
        runner.graphs = EagerGraphs(runner.model, runner.kv_caches, runner.backend, capture_sizes(8),
                                    runner.max_model_len, runner.block_size, scratch, torch.device("cpu"))  # fmt: skip

    expected, _ = serve(tiny, block_size)
    eager, runner = serve(tiny, block_size, flashinfer)
    assert eager == expected
    assert runner.backend.decode_wrapper.runs and runner.backend.prefill_wrapper.runs
    staged, runner = serve(tiny, block_size, graphs)
    assert staged == expected
    graphed = runner.graphs
    assert graphed.padded_steps > 0, "some decode steps were meant to be padded"
    assert sum(wrapper.runs for wrapper in graphed.wrappers.values()) > 0
    assert set(graphed.wrappers) == {1, 2, 4, 8}
