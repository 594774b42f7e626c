"""xformers' memory-efficient attention for prefill chunks on CUDA (the [cuda] extra; imported only when
chosen), over the same paged cache; decode rows take the torch reference's SDPA path. A chunk attends to
its cached context and causally to itself, the mask aligned to the end of its keys, as FlashInfer's is."""

from __future__ import annotations

import torch

from worker.attention.base import PrefillChunk
from worker.attention.torch_ref import TorchAttentionBackend, chunk_keys_values


class XformersBackend(TorchAttentionBackend):
    name = "xformers"

    def __init__(self) -> None:
        from xformers import ops  # type: ignore[import-not-found]

        self.xops = ops  # NOTE: not `ops`, which names the csrc kernels the model and sampler look for

    def prefill_chunk(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        start, end = chunk.token_start, chunk.token_end
        k, v = chunk_keys_values(kv_cache, chunk)  # [S, kvh, d]
        seq_len = k.shape[0]
        q = query[start:end]  # [n, heads, d]
        group = q.shape[1] // num_kv_heads
        # [batch 1, seq, kv heads, group, d]: xformers' grouped-query layout
        q5 = q.view(1, end - start, num_kv_heads, group, head_dim)
        k5 = k[None, :, :, None, :].expand(1, seq_len, num_kv_heads, group, head_dim)
        v5 = v[None, :, :, None, :].expand(1, seq_len, num_kv_heads, group, head_dim)
        bias = self.xops.fmha.attn_bias.LowerTriangularFromBottomRightMask()
        out = self.xops.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias, scale=scale)
        output[start:end] = out.view(end - start, num_kv_heads * group, head_dim)
