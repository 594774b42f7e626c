"""The paged-attention backend contract.

KV layout per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (2 = key, value).
Tokens of a step are flattened: decode requests (one query token each) first, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch


@dataclass
class PrefillChunk:
    """One request's run of query tokens in the step."""

    token_start: int  # first row of this chunk in the flattened token tensors
    token_end: int
    context_len: int  # tokens already in the KV cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] the request's block table (long)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[num_query, seq_len] bool, query i sees keys 0..context_len + i; None when causal from
        position 0. Built on first use (only SDPA paths need it), then shared by the step's layers."""
        if self.context_len == 0:
            return None
        n, device = self.token_end - self.token_start, self.block_ids.device  # the cache's device
        keys = torch.arange(self.context_len + n, device=device)
        return keys[None, :] <= (self.context_len + torch.arange(n, device=device))[:, None]


@dataclass(frozen=True)
class ImageRun:
    """Rows of a prefill chunk that are one run of an image's tokens in a model whose image tokens see each
    other both ways (Gemma 3): they see the run's every position, [first, end), beside the causal keys."""

    row_start: int  # the step's rows of the run's tokens in this step
    row_end: int
    first: int  # the run's positions, in the request
    end: int


@dataclass
class AttentionMetadata:
    num_decode_tokens: int  # rows [0, num_decode_tokens) are one-token decode requests
    slot_block_ids: torch.Tensor  # [num_tokens] block of each new token's KV (long)
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block (long)
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] (long, padded with 0)
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] tokens in the cache, the new one included
    prefills: list[PrefillChunk] = field(default_factory=list)
    scratch: dict[Any, Any] = field(default_factory=dict)  # a backend's per-step plans, shared by the layers
    # the same step over the windowed layers' pool, for a model that has one (worker/kv_groups.py)
    window_group: AttentionMetadata | None = None
    # [num_tokens] (long) 1 where a longrope model's row runs on its long factors (worker/models/rope.py)
    long_rope: torch.Tensor | None = None
    # [num_tokens] (long) each row's prompt length, for a dynamic NTK rope served past its limit
    prompt_lens: torch.Tensor | None = None
    image_runs: list[ImageRun] = field(default_factory=list)  # worker/models/image_attention.py


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,  # > 0: a query at position p sees keys p - window < k <= p (a sliding layer)
        softcap: float = 0.0,  # > 0: scores -> softcap * tanh(scores / softcap) before the softmax
        sinks: torch.Tensor | None = None,  # [num_heads] float32: each head's attention sink (gpt-oss)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def paged_rows(
        self, metadata: AttentionMetadata, num_tokens: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # [num_tokens, max_blocks], [num_tokens]
        """When every token of the step is one row of the paged kernel: each row's block table and
        length (the model may then run its layers in one native call); else None."""
        ...
