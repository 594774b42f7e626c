"""The fast CPU backend: decode attention by the csrc kernel, reading blocks in place (no gather), and
new keys and values written into the cache by one kernel call.

Prefill chunks use the reference path (their cost is in the matrix products, not the gather). `ops`
(the csrc module) is public: the model's fused layers use the same kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.attention.base import AttentionMetadata
from worker.attention.torch_ref import TorchAttentionBackend


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
