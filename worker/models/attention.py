"""A decoder layer's attention: fused q/k/v product, the family's q/k norms, rotary, paged attention with
the layer's window, scale and soft-capping, and the output product.

q/k norms (ModelConfig.qk_norm): "head" normalizes each head with one [head_dim] weight (Qwen3, Gemma 3),
"head_each" with a weight per head (Command R, StableLM), "proj" the whole q and k projections before
they are split into heads (OLMo 2); all before rotary, as transformers does. A NoPE layer (SmolLM3) skips
rotary; a sliding layer (ModelConfig.is_sliding) sees its window's keys only; attention sinks (gpt-oss) add
a logit per head to the softmax's sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.model_config import ModelConfig
from worker.models.image_attention import attend_image_runs
from worker.models.layers import Linear
from worker.models.norms import Norm, make_norm
from worker.models.rope import Rope

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None,
        index: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.index = index  # the layer's, for its LoRA slots
        self.tp = tp  # config holds this rank's heads; o_proj's partial sums are all-reduced
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.query_scale
        self.window = config.sliding_window if config.is_sliding(index) else 0
        self.softcap = config.attn_softcap
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)
            if config.attention_sinks
            else None
        )
        self.uses_rope = index not in config.nope_layers
        self.rope_kind = "local" if config.rope_local_theta and config.is_sliding(index) else "global"
        hidden = config.hidden_size
        self.qkv_proj = Linear(
            hidden, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = Linear(self.q_size, hidden, bias=config.o_bias, dtype=dtype)
        self.qk_norm = config.qk_norm
        eps, kind = config.rms_norm_eps, config.norm
        self.q_norm: Norm | None
        self.k_norm: Norm | None
        if config.qk_norm == "head":
            self.q_norm, self.k_norm = (make_norm(kind, self.head_dim, eps, dtype, ops) for _ in range(2))
        elif config.qk_norm == "head_each":
            self.q_norm = make_norm(kind, self.head_dim, eps, dtype, heads=self.num_heads)
            self.k_norm = make_norm(kind, self.head_dim, eps, dtype, heads=self.num_kv_heads)
        elif config.qk_norm == "proj":
            self.q_norm = make_norm(kind, self.q_size, eps, dtype, ops)
            self.k_norm = make_norm(kind, self.kv_size, eps, dtype, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        ropes: dict[str, Rope],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """out_rows: the rows to return (all when None); every row's keys and values are written.
        lora: the step's adapters (of out_rows' rows for o_proj), added to each product they target."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        if lora is not None:
            lora.add(self.index, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "proj":
            assert self.q_norm is not None and self.k_norm is not None
            if self.tp is not None:
                q, k = self.sharded_proj_norms(q, k)
            else:
                q, k = self.q_norm(q), self.k_norm(k)  # [num_tokens, q_size], [num_tokens, kv_size]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm in ("head", "head_each"):
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        if self.uses_rope:
            q, k = ropes[self.rope_kind].apply(q, k)
        if self.sinks is None:
            out = backend.forward(q, k, v, kv_cache, metadata, self.scale, self.window, self.softcap)
        else:
            out = backend.forward(
                q, k, v, kv_cache, metadata, self.scale, self.window, self.softcap, self.sinks
            )
        if metadata.image_runs:  # Gemma 3's image tokens see their whole run
            attend_image_runs(q, kv_cache, metadata, self.scale, self.window, self.softcap, out)
        if out_rows is not None:
            out = out.index_select(0, out_rows)  # [rows, heads, head_dim]
        out = out.reshape(-1, self.q_size)
        projected: torch.Tensor = self.o_proj(out)  # [rows, hidden]
        if lora is not None:
            (lora if out_rows is None else lora.select(out_rows)).add(self.index, "o", out, projected)
        if self.tp is not None:
            projected = self.tp.all_reduce(projected)
        return projected

    def sharded_proj_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's RMS norms over whole projections of which this rank holds a slice (and its columns of
        the weights): the ranks' sums of squares all-reduced, then transformers' rounding. Over all ranks a
        replicated KV head counts once per rank that holds it, as every head does, so the mean holds."""
        assert self.tp is not None and self.q_norm is not None and self.k_norm is not None
        q32, k32 = q.float(), k.float()
        sums = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1)  # [num_tokens, 2]
        sums = self.tp.all_reduce(sums)
        size = self.tp.size
        out = []
        for x, x32, norm, total, width in ((q, q32, self.q_norm, sums[:, :1], self.q_size),
                                           (k, k32, self.k_norm, sums[:, 1:], self.kv_size)):  # fmt: skip
            normed = (x32 * torch.rsqrt(total / (width * size) + norm.eps)).to(x.dtype)
            out.append(norm.weight * normed)
        return out[0], out[1]
