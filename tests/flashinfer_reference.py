"""A torch reference of FlashInfer's paged attention, on CPU tensors, for the tests that need no GPU.

flashinfer_reference computes what FlashInfer's documentation says a plan means. reference_module() is a
stand-in for the `flashinfer` package with the two wrappers our backend uses (flashinfer-python 0.7.4's
names and plan/run signatures, its CUDA-graph mode included: a fixed batch, plans copied into the caller's
buffers, run() reading those buffers), each computing with flashinfer_reference. Our FlashInferBackend and
the CUDA-graph staging then run on the CPU against it: what they plan and where they read is checked here,
the kernels themselves only on a GPU (tests/gpu/).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from worker.attention.flashinfer_meta import PagedPlan


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


def _int32(*tensors: torch.Tensor) -> None:
    assert all(t.dtype == torch.int32 for t in tensors), [t.dtype for t in tensors]


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.plan_args: tuple[Any, ...] | None = None
        self.runs = 0

    def _check_run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[PagedPlan, float]:
        assert self.plan_args is not None, "run() before plan()"
        plan, heads, kv_heads, head_dim, page_size, dtype, scale = self.plan_args
        assert kv_cache.shape[1:] == (2, page_size, kv_heads, head_dim), kv_cache.shape
        assert query.shape[1:] == (heads, head_dim) and query.dtype == dtype == kv_cache.dtype
        self.runs += 1
        return plan, scale


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None, paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__(workspace, kv_layout)
        self.graph_buffers = None
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_indices_buffer is not None
            assert paged_kv_last_page_len_buffer is not None
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.graph_buffers = (
                paged_kv_indptr_buffer,
                paged_kv_indices_buffer,
                paged_kv_last_page_len_buffer,
            )

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str, q_data_type: torch.dtype,
             kv_data_type: torch.dtype, sm_scale: float) -> None:  # fmt: skip
        _int32(indptr, indices, last_page_len)
        assert pos_encoding_mode == "NONE" and q_data_type == kv_data_type
        assert bool((last_page_len >= 1).all() and (last_page_len <= page_size).all())
        plan = PagedPlan(indptr, indices, last_page_len)
        if self.graph_buffers is not None:  # FlashInfer's graph mode: a fixed batch, the plan in our buffers
            indptr_buffer, indices_buffer, last_buffer = self.graph_buffers
            assert len(last_page_len) == len(last_buffer), "the batch size is fixed in cudagraph mode"
            assert len(indices) <= len(indices_buffer)
            indptr_buffer.copy_(indptr)
            last_buffer.copy_(last_page_len)
            indices_buffer[: len(indices)].copy_(indices)
            plan = PagedPlan(indptr_buffer, indices_buffer, last_buffer)  # what a replayed graph reads
        self.plan_args = (plan, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, sm_scale)

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        plan, scale = self._check_run(query, kv_cache)
        assert query.shape[0] == plan.batch_size, (query.shape, plan.batch_size)
        return flashinfer_reference(query, kv_cache, plan, scale, causal=False)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
             causal: bool, pos_encoding_mode: str, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             sm_scale: float) -> None:  # fmt: skip
        _int32(qo_indptr, kv_indptr, kv_indices, last_page_len)
        assert causal and pos_encoding_mode == "NONE" and q_data_type == kv_data_type
        plan = PagedPlan(kv_indptr, kv_indices, last_page_len, qo_indptr=qo_indptr)
        self.plan_args = (plan, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, sm_scale)

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        plan, scale = self._check_run(query, kv_cache)
        assert plan.qo_indptr is not None and query.shape[0] == int(plan.qo_indptr[-1])
        return flashinfer_reference(query, kv_cache, plan, scale, causal=True)


def reference_module() -> types.ModuleType:
    """A `flashinfer` for sys.modules (monkeypatch.setitem) whose wrappers compute with the reference."""
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    return module
