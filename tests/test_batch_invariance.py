"""Batch-invariant greedy (docs/batch-invariance.md): a prompt's greedy tokens are the same alone, in
shuffled batches of 4, 16 and 64 with other prompts' prefills arriving between its steps, with prefix-cache
hits and misses, in small and large steps, with and without async scheduling, in bf16 and float32.
Bit-exact, on a tiny random-weight Llama whose near-tied logits show any difference in the sums.
(tests/test_correctness_tiny.py keeps the comparison against HF transformers; this replaces none of it.)"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.test_correctness_tiny import build_tiny
from worker.executor import InprocExecutor

pytestmark = pytest.mark.slow

NUM_PROMPTS = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_and_prompts(tmp_path_factory):  # type: ignore[no-untyped-def]
    from worker.csrc_ops import load_cpu_ops

    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: batch invariance needs the csrc kernels")
    folder = str(tmp_path_factory.mktemp("invariant"))
    build_tiny("llama", folder)
    rng = random.Random(25)
    shared = [rng.randrange(512) for _ in range(48)]  # three blocks of 16: prefix-cache hits
    prompts = [[rng.randrange(512) for _ in range(rng.randint(4, 150))] for _ in range(NUM_PROMPTS - 8)]
    prompts += [shared + [rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    return folder, prompts


def engine(folder: str, dtype: str, **engine_kwargs: Any) -> EngineCore:
    worker = WorkerConfig(model=folder, dtype=dtype, block_size=16, max_num_seqs=64, batch_invariant=True)
    return EngineCore(EngineConfig(worker=worker, max_num_seqs=64, **engine_kwargs), InprocExecutor(worker))


def greedy(
    core: EngineCore, requests: list[tuple[str, list[int]]], batch: int
) -> dict[str, list[tuple[int, float]]]:
    """(token, its logprob) of each step of each request: the logprob shows any change in the sums, where
    a token shows only those large enough to flip it. The requests go in waves of `batch`; a wave's
    requests arrive one a step, so their prefills meet the decode rows (and chunks) of those before them."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[tuple[int, float]]] = {request_id: [] for request_id, _ in requests}

    def step() -> None:
        for _, output in core.step():
            assert output.new_logprobs is not None
            logprobs = [row[0] for row in output.new_logprobs.logprobs]
            tokens[output.request_id].extend(zip(output.new_token_ids, logprobs, strict=True))

    for start in range(0, len(requests), batch):
        for request_id, prompt in requests[start : start + batch]:
            core.add_request(
                AddRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling_params=params, arrival_time=0
                )
            )
            step()
        while core.has_unfinished_requests():
            step()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return tokens


RUNS = {
    "batches of 4, 64-token steps, async": dict(batch=4, max_num_batched_tokens=64, async_scheduling=True),
    "batches of 16, 256-token steps": dict(batch=16, max_num_batched_tokens=256, async_scheduling=False),
    "batches of 64, 2048-token steps, async": dict(
        batch=64, max_num_batched_tokens=2048, async_scheduling=True
    ),
    "batches of 16, 40-token steps, no prefix caching": dict(
        batch=16, max_num_batched_tokens=40, async_scheduling=False, enable_prefix_caching=False
    ),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_do_not_depend_on_the_batch(model_and_prompts, dtype: str) -> None:  # type: ignore[no-untyped-def]
    folder, prompts = model_and_prompts
    alone_core = engine(folder, dtype, enable_prefix_caching=False, async_scheduling=False)
    alone = greedy(alone_core, [(str(i), prompt) for i, prompt in enumerate(prompts)], batch=1)
    assert all(len(tokens) == MAX_TOKENS for tokens in alone.values())
    rng = random.Random(dtype)
    for name, run in RUNS.items():
        kwargs = dict(run)
        batch = kwargs.pop("batch")
        requests = [(f"{i}.{copy}", prompt) for copy in range(2) for i, prompt in enumerate(prompts)]
        rng.shuffle(requests)  # 64 requests: every prompt twice, in a new order each run
        core = engine(folder, dtype, **kwargs)
        tokens = greedy(core, requests, batch)
        if kwargs.get("enable_prefix_caching", True):
            assert core.scheduler.kv_cache.prefix_cache_hits > 0, name  # the shared prefix and the copies
        differing = sorted(
            {
                request_id.split(".")[0]
                for request_id, ids in tokens.items()
                if ids != alone[request_id.split(".")[0]]
            }
        )
        assert not differing, f"{name}: prompts {differing} changed with the batch"
