"""The FlashInfer plan our metadata builds (worker/attention/flashinfer_meta.py), read by a torch reference
of FlashInfer's documented paged-attention semantics on CPU tensors, equals our CPU attention on the same
steps: real scheduling of a tiny model with prefill chunks, decode rows, prefix-cache hits and requests
preempted and resumed, at block sizes 16 and 64. No GPU: this is what the GPU backend plans from."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.test_tensor_parallel import build
from worker.attention.flashinfer_meta import PagedPlan, decode_plan, step_plans
from worker.executor import InprocExecutor

VOCAB = 515


def flashinfer_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: PagedPlan, scale: float, causal: bool
) -> torch.Tensor:
    """query: [rows, heads, head_dim] (decode: one row a request; prefill: qo_indptr's rows); kv_cache NHD
    [pages, 2, page_size, kv_heads, head_dim]. Request i's keys are its pages in kv_indices order, the last
    one cut at kv_last_page_len; a causal row j of n sees keys up to kv_len - n + j."""
    page_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for i in range(plan.batch_size):
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(plan.kv_last_page_len[i])
        k = kv_cache[pages, 0].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()  # [L, kvh, d]
        v = kv_cache[pages, 1].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        rows = range(i, i + 1) if plan.qo_indptr is None else range(plan.qo_indptr[i], plan.qo_indptr[i + 1])
        q = query[rows.start : rows.stop].float()  # [n, heads, d]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, heads, d]
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        if causal:
            n = len(rows)
            visible = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]  # [n, L]
            scores = scores.masked_fill(~visible[None], float("-inf"))
        out[rows.start : rows.stop] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).to(query.dtype)
    return out


class CheckingBackend:
    """Our attention backend, with every layer's output checked against the reference of the plan."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: Counter[str] = Counter()

    def forward(self, query, key, value, kv_cache, metadata, scale):  # type: ignore[no-untyped-def]
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
