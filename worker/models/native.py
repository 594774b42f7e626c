"""The csrc decoder stack (csrc/decoder_cpu.cpp): which models it runs, and each layer's weights in its order.

It runs a pre-norm decoder with RMSNorms, a SiLU-gated MLP without biases, q/k/v biases and per-head q/k
RMSNorms where a family has them, full rotate-half rotary, and no window or soft-capping; any query scale.
Any other family runs the Python layers (the same kernels where they apply, with Python between them).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model_config import ModelConfig
from worker.models.decoder import DecoderLayer
from worker.models.layers import Linear


def native_stack_serves(config: ModelConfig) -> bool:
    return (
        config.norm == "rms"
        and config.layout == "pre"
        and config.mlp == "gated"
        and config.hidden_act == "silu"
        and not (config.o_bias or config.mlp_bias)
        and config.qk_norm in ("", "head")
        and not (
            config.rotary_dim or config.rope_interleaved or config.nope_layers or config.rope_local_theta
        )
        and not (config.sliding_window or config.attn_softcap)
        and config.residual_multiplier == 1.0
    )


def native_shape(layer: DecoderLayer) -> list[int]:
    """The stack's config: heads, kv heads, head_dim, packed (0/1), pairs_rows."""
    attention, down = layer.self_attn, layer.mlp.down_proj
    packed = int(down.packed is not None)
    return [attention.num_heads, attention.num_kv_heads, attention.head_dim, packed, down.pairs_rows]


def native_weights(layer: DecoderLayer) -> list[torch.Tensor]:
    """One layer's weights in csrc/decoder_cpu.cpp's order; an empty tensor for an absent bias or norm."""
    attention, mlp, none = layer.self_attn, layer.mlp, torch.empty(0)
    assert (
        layer.input_layernorm is not None and layer.post_attention_layernorm is not None
    )  # a pre-norm layer

    def weight(linear: Linear) -> torch.Tensor:
        return (linear.packed if linear.packed is not None else linear.weight).detach()

    def optional(module: nn.Module | None, name: str) -> torch.Tensor:
        tensor = getattr(module, name, None) if module is not None else None
        return tensor.detach() if tensor is not None else none

    def packing(linear: Linear) -> torch.Tensor:
        """csrc's packing of a product: linear_rows' 3-d, linear_amx's 5-d view of the pairs, the pairs 4-d."""
        if linear.amx:
            assert linear.pairs is not None
            groups, kpairs, width, two = linear.pairs.shape
            return linear.pairs.view(groups, kpairs // 16, 16, width, two)
        return optional(linear, "rows" if linear.rows is not None else "pairs")

    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)

    return [
        layer.input_layernorm.weight.detach(), weight(attention.qkv_proj), optional(attention.qkv_proj, "bias"),
        weight(attention.o_proj), layer.post_attention_layernorm.weight.detach(), weight(mlp.gate_up_proj),
        weight(mlp.down_proj), optional(attention.q_norm, "weight"), optional(attention.k_norm, "weight"),
        *(packing(linear) for linear in linears),
    ]  # fmt: skip
