"""The fast CPU backend: decode attention by the csrc kernel, reading blocks in place (no gather).

Prefill chunks use the reference path (their cost is in the matrix products, not the gather).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.attention.base import AttentionMetadata
from worker.attention.torch_ref import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        return self._ops.paged_decode_attention(
            query.contiguous(), kv_cache, metadata.decode_block_tables, metadata.decode_seq_lens, scale
        )
