"""The shared decoder every family runs (worker/models/families/ says what each changes), on paged attention.

Tokens are flattened across requests: every tensor is [num_tokens, ...]; attention reads and writes the
paged KV cache through the backend, so the model never sees padding.

A layer returns (its output, the residual stream before it): their sum is the hidden state. Keeping the
two apart lets the next norm fuse the residual add (HF's rounding is the same), and lets each layout add
its branches in transformers' order (float32 addition is not associative):
- "pre" (Llama): x + attn(norm(x)), then + mlp(norm(.));
- "sandwich" (Gemma 2/3, GLM-4): the attention's and the MLP's outputs normed before their adds;
- "post" (OLMo 2): no norm before attention or MLP, their outputs normed;
- "parallel" (GPT-NeoX): (mlp(norm2(x)) + attn(norm1(x))) + x;
- "parallel_shared" (Command R, StableLM): (x + attn(norm(x))) + mlp(norm(x)).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.model_config import ModelConfig
from worker.models.attention import Attention
from worker.models.mla import LatentAttention
from worker.models.mlp import MLP
from worker.models.moe import SparseMoE
from worker.models.norms import Norm, make_norm
from worker.models.rope import Rope

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup

logger = logging.getLogger("engine.worker")
LAYOUTS = ("pre", "sandwich", "post", "parallel", "parallel_shared")


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None,
        index: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        if config.layout not in LAYOUTS:
            raise ValueError(f"unknown decoder layout {config.layout!r}; known: {', '.join(LAYOUTS)}")
        self.layout = config.layout
        self.residual_multiplier = config.residual_multiplier

        def norm() -> Norm:
            return make_norm(
                config.norm, config.hidden_size, config.rms_norm_eps, dtype, ops, config.norm_bias
            )

        # names by role: input_layernorm before attention, post_attention_layernorm before the MLP (Llama's
        # names), post_attn_norm and post_mlp_norm on the two outputs
        self.input_layernorm: Norm | None = norm() if config.layout != "post" else None
        self.self_attn: Attention | LatentAttention = (
            LatentAttention(config, dtype, ops, index, tp)
            if config.kv_lora_rank
            else Attention(config, dtype, ops, index, tp)
        )
        two_norms = config.layout in ("pre", "sandwich", "parallel")
        self.post_attention_layernorm: Norm | None = norm() if two_norms else None
        self.post_attn_norm: Norm | None = norm() if config.layout in ("sandwich", "post") else None
        self.post_mlp_norm: Norm | None = norm() if config.layout in ("sandwich", "post") else None
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, dtype, ops, index, tp)
            if config.is_moe_layer(index)
            else MLP(config, dtype, ops, index, tp)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: dict[str, Rope],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it), of the rows out_rows names (all
        when None)."""
        if self.input_layernorm is None:  # "post": attention reads the stream itself
            residual = x if residual is None else x + residual
            h = residual
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attended = self.self_attn(h, ropes, kv_cache, metadata, backend, out_rows, lora)
        if out_rows is not None:
            residual = residual.index_select(0, out_rows)
            if not len(out_rows):
                return (
                    attended,
                    residual,
                )  # nothing scored: the keys and values were all this layer had to give
            h = h.index_select(0, out_rows)
            if lora is not None:
                lora = lora.select(out_rows)
        if self.post_attn_norm is not None:
            attended = self.post_attn_norm(attended)
        attended = self._scaled(attended)
        if self.layout == "parallel":  # GPT-NeoX: (mlp + attn) + x
            assert self.post_attention_layernorm is not None
            mlp_in = self.post_attention_layernorm(residual)
            return self._scaled(self.mlp(mlp_in, lora)) + attended, residual
        if self.layout == "parallel_shared":  # Command R, StableLM: (x + attn) + mlp
            return self._scaled(self.mlp(h, lora)), residual + attended
        if self.post_attention_layernorm is not None:
            h, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        else:  # "post": the MLP reads the stream
            residual = attended + residual
            h = residual
        out = self.mlp(h, lora)
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        return self._scaled(out), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x
