"""FlashInfer's description of a step over our paged KV cache, built from our AttentionMetadata.

FlashInfer's paged wrappers take, per request i of a batch: its pages, `kv_indices[kv_indptr[i] :
kv_indptr[i + 1]]`, in order; how many slots of its last page hold tokens, `kv_last_page_len[i]` in [1,
page_size]; and, for prefill, its query rows `qo_indptr[i] : qo_indptr[i + 1]` (relative to the first
prefill row). A prefill chunk's causal mask is aligned to the end of its keys: query row j of n attends
to keys up to position kv_len - n + j, which is our chunk's context_len + j. Our cache layout per layer,
[num_blocks, 2, block_size, num_kv_heads, head_dim], is FlashInfer's NHD paged cache with pages = blocks.

Pure index arithmetic on host tensors (int32, as FlashInfer plans them): tested on the CPU against a
reference of these semantics (tests/test_flashinfer_plan.py), used on the GPU by worker/attention/flashinfer.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention.base import AttentionMetadata, PrefillChunk


@dataclass
class PagedPlan:
    kv_indptr: torch.Tensor  # [batch + 1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32: page (block) ids, each request's in order
    kv_last_page_len: torch.Tensor  # [batch] int32, in [1, page_size]
    qo_indptr: torch.Tensor | None = None  # [batch + 1] int32, prefill only: query rows per request

    @property
    def batch_size(self) -> int:
        return len(self.kv_last_page_len)


def _pages(seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages per request, tokens in each last page) for sequence lengths >= 1."""
    pages = (seq_lens + page_size - 1) // page_size
    return pages, seq_lens - (pages - 1) * page_size


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros(1, dtype=torch.int64, device=counts.device)
    return torch.cat([zero, torch.cumsum(counts, 0)]).to(torch.int32)


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> PagedPlan:
    """block_tables: [batch, max_blocks] (padded); seq_lens: [batch], the new token included."""
    pages, last = _pages(seq_lens.to(block_tables.device, torch.int64), page_size)
    width = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :]
    indices = block_tables[width < pages[:, None]]  # row by row, each request's first `pages` blocks
    return PagedPlan(_indptr(pages), indices.to(torch.int32), last.to(torch.int32))


def prefill_plan(chunks: list[PrefillChunk], page_size: int) -> PagedPlan:
    """One request per chunk: its query rows and every page of its keys (context and chunk)."""
    query_lens = torch.tensor([chunk.token_end - chunk.token_start for chunk in chunks], dtype=torch.int64)
    seq_lens = torch.tensor([chunk.context_len + chunk.token_end - chunk.token_start for chunk in chunks])
    pages, last = _pages(seq_lens, page_size)
    indices = [chunk.block_ids[: int(n)] for chunk, n in zip(chunks, pages, strict=True)]
    return PagedPlan(
        _indptr(pages),
        torch.cat(indices).to(torch.int32) if indices else torch.zeros(0, dtype=torch.int32),
        last.to(torch.int32),
        qo_indptr=_indptr(query_lens),
    )


def step_plans(metadata: AttentionMetadata, page_size: int) -> tuple[PagedPlan | None, PagedPlan | None]:
    """(the decode rows' plan, the prefill chunks' plan) of one step; None for a part the step lacks."""
    decode = None
    if metadata.num_decode_tokens:
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        decode = decode_plan(metadata.decode_block_tables, metadata.decode_seq_lens, page_size)
    prefill = prefill_plan(metadata.prefills, page_size) if metadata.prefills else None
    return decode, prefill


def pad_decode_plan(plan: PagedPlan, size: int, scratch_block: int) -> PagedPlan:
    """A decode plan of n <= size requests as one of `size` (a CUDA graph's fixed batch): each padding row is a
    request of one token in the scratch block, which the engine never hands out."""
    pad = size - plan.batch_size
    if pad < 0:
        raise ValueError(f"a decode step of {plan.batch_size} rows does not fit a batch of {size}")
    ones = torch.ones(pad, dtype=torch.int32)
    last = plan.kv_indptr[-1:].to(torch.int32)
    return PagedPlan(
        torch.cat([plan.kv_indptr, last + torch.arange(1, pad + 1, dtype=torch.int32)]),
        torch.cat([plan.kv_indices, torch.full((pad,), scratch_block, dtype=torch.int32)]),
        torch.cat([plan.kv_last_page_len, ones]),
    )


def empty_plan() -> PagedPlan:
    """No request: what pad_decode_plan makes a batch of padding rows alone from (a graph's capture)."""
    return PagedPlan(
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
    )
