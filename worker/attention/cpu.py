"""The fast CPU backend: decode attention by the csrc kernel, reading blocks in place (no gather), and
new keys and values written into the cache by one kernel call.

Prefill: chunks after a cached context are batched into padded SDPA calls; fresh ones go one by one. `ops`
(the csrc module) is public: the model's fused layers use the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata, PrefillChunk
from worker.attention.torch_ref import TorchAttentionBackend

# Padded keys (chunks x longest block table x block size) one batched prefill call may gather.
PREFILL_BATCH_TOKENS = 64 * 1024


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        self.ops.write_kv(key, value, kv_cache, metadata.slot_block_ids, metadata.slot_offsets)

    def decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        return self.ops.paged_decode_attention(
            query.contiguous(), kv_cache, metadata.decode_block_tables, metadata.decode_seq_lens, scale
        )

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Chunks after a cached context (prefix-cache hits, later chunks of long prompts), when there
        are several: batched SDPA calls over their KV read back from the cache (the new tokens are
        already written), one call per group instead of one per chunk. A step that prefilled 15 requests
        of 64 tokens after a 512-token cached prefix spent 380 us in each of 450 small calls."""
        plan = metadata.scratch.get("prefill_plan")
        if plan is None:  # the first layer plans the step; the others reuse the plan
            plan = metadata.scratch["prefill_plan"] = plan_prefill(metadata.prefills, kv_cache.shape[2])
        singles, groups = plan
        for chunk in singles:
            self.prefill_chunk(query, key, value, kv_cache, chunk, scale, output)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        for group in groups:
            batch, keys_len = group.tables.shape[0], group.keys_len
            blocks = kv_cache[group.tables]  # [B, max_blocks, 2, block_size, kv_heads, head_dim]
            k = (
                blocks[:, :, 0].reshape(batch, keys_len, num_kv_heads, head_dim).transpose(1, 2)
            )  # [B, kvh, S, d]
            v = blocks[:, :, 1].reshape(batch, keys_len, num_kv_heads, head_dim).transpose(1, 2)
            q = query[group.rows].transpose(1, 2)  # [B, heads, n, d]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True
            ).transpose(1, 2)  # [B, n, heads, d]
            output[group.valid_rows] = out[group.valid]


@dataclass
class PrefillGroup:
    tables: torch.Tensor  # [B, max_blocks] block ids, padded with block 0 (masked out)
    keys_len: int  # max_blocks * block_size
    rows: torch.Tensor  # [B, n] each chunk's query rows, padded with its first row (results dropped)
    mask: torch.Tensor  # [B, 1, n, keys_len] query i of chunk b sees keys 0..context_b + i
    valid: torch.Tensor  # [B, n] bool: real query rows
    valid_rows: torch.Tensor  # [num valid] their rows in the step's flattened tokens


def plan_prefill(
    chunks: list[PrefillChunk], block_size: int
) -> tuple[list[PrefillChunk], list[PrefillGroup]]:
    """(chunks prefilled one by one, batched groups). Fresh chunks (no cached context) keep SDPA's causal
    path one call each, with no mask to build; chunks after a context are batched when there are several."""
    with_context = [chunk for chunk in chunks if chunk.context_len > 0]
    if len(with_context) < 2:
        return chunks, []
    fresh = [chunk for chunk in chunks if chunk.context_len == 0]
    return fresh, plan_prefill_groups(with_context, block_size)


def plan_prefill_groups(chunks: list[PrefillChunk], block_size: int) -> list[PrefillGroup]:
    """Chunks batched in order, each group's padded keys (B x longest table) at most PREFILL_BATCH_TOKENS."""
    groups: list[list[PrefillChunk]] = [[]]
    widest = 0
    for chunk in chunks:
        blocks = int(chunk.block_ids.numel())
        if groups[-1] and (len(groups[-1]) + 1) * max(widest, blocks) * block_size > PREFILL_BATCH_TOKENS:
            groups.append([])
            widest = 0
        groups[-1].append(chunk)
        widest = max(widest, blocks)
    return [_plan_group(group, block_size) for group in groups]


def _plan_group(chunks: list[PrefillChunk], block_size: int) -> PrefillGroup:
    batch = len(chunks)
    lengths = [c.token_end - c.token_start for c in chunks]
    longest = max(lengths)
    max_blocks = max(int(c.block_ids.numel()) for c in chunks)
    tables = torch.zeros(batch, max_blocks, dtype=torch.long)
    rows = torch.zeros(batch, longest, dtype=torch.long)
    for b, chunk in enumerate(chunks):
        tables[b, : chunk.block_ids.numel()] = chunk.block_ids
        rows[b] = chunk.token_start
        rows[b, : lengths[b]] = torch.arange(chunk.token_start, chunk.token_end)
    context = torch.tensor([c.context_len for c in chunks])
    keys_len = max_blocks * block_size
    limit = context[:, None] + torch.arange(longest)[None, :]  # [B, n] each query's position
    mask = torch.arange(keys_len)[None, None, :] <= limit[:, :, None]  # [B, n, S]
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [B, n]
    return PrefillGroup(tables, keys_len, rows, mask.unsqueeze(1), valid, rows[valid])
