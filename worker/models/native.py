"""The csrc decoder stack (csrc/decoder_cpu.cpp): which models it runs, and each layer's weights in its order.

It runs the "pre", "sandwich" and "post" layouts with RMSNorms (Gemma's 1 + w ones too), and the "pre",
"parallel" (GPT-NeoX) and "parallel_shared" (StableLM, Command R) ones with LayerNorms or Command R's own;
SiLU-, GELU(tanh)- or GELU-gated MLPs and plain GELU ones; biases on any product; q/k norms per head or
over the projection (with RMSNorms), or a weight per head (with LayerNorms: StableLM's, Command R's);
rotary over whole heads or their leading dims, rotate-half or interleaved, with a local base for the
sliding layers; NoPE layers; sliding windows (in the windowed layers' own pool where the model keeps one);
attention soft-capping and sinks; DeepSeek's latent attention; any query scale and a residual multiplier;
act-order products (their inputs' columns gathered first, once or part by part); mixtures of experts
(route_experts and fused_experts in the MLP's place, a shared expert in the MLP's slots). That is every
family."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from worker.model_config import ModelConfig
from worker.models.attention import Attention
from worker.models.decoder import DecoderLayer
from worker.models.experts import EXPERT_ACTIVATIONS, Experts
from worker.models.layers import Linear
from worker.models.mla import LatentAttention
from worker.models.moe import ROUTERS, SparseMoE
from worker.models.norms import Norm, OffsetRMSNorm

LAYOUTS = {"pre": 0, "sandwich": 1, "post": 2, "parallel": 3, "parallel_shared": 4}
MLPS = {("gated", "silu"): 0, ("gated", "gelu_tanh"): 1, ("gated", "gelu"): 2, ("plain", "gelu_tanh"): 3,
        ("plain", "gelu"): 4}  # fmt: skip
QK_NORMS = {"": 0, "head": 1, "proj": 2, "head_each": 3}
# (Gemma's 1 + w: the rms kernel with a float32 weight)
NORM_KINDS = {"rms": 0, "rms_offset": 0, "layer": 1, "cohere": 2}


def native_stack_serves(config: ModelConfig) -> bool:
    if (config.mlp, config.hidden_act) not in MLPS or config.layout not in LAYOUTS:
        return False
    if config.norm in ("rms", "rms_offset"):  # every layout but the parallel ones (no family has both)
        return config.qk_norm in ("", "head", "proj") and config.layout in ("pre", "sandwich", "post")
    # LayerNorms (through ATen) and Command R's: before the branches or parallel, q/k norms a weight per head
    return (
        config.norm in ("layer", "cohere")
        and config.qk_norm in ("", "head_each")
        and config.layout in ("pre", "parallel", "parallel_shared")
    )


def native_shape(layer: DecoderLayer, config: ModelConfig) -> list[int]:
    """The stack's config: heads, kv heads, head_dim, packed (0/1), pairs_rows, layout, MLP, q/k norm,
    interleaved rotary (0/1), norm kind (NORM_KINDS). Latent attention: one KV head of the latent's width."""
    attention, o = layer.self_attn, layer.self_attn.o_proj
    packed = int(o.packed is not None)
    if isinstance(attention, LatentAttention):
        heads, kv_heads, head_dim = attention.num_heads, 1, attention.rank + attention.rope
    else:
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    return [
        heads, kv_heads, head_dim, packed, o.pairs_rows,
        LAYOUTS[config.layout], MLPS[(config.mlp, config.hidden_act)], QK_NORMS[config.qk_norm],
        int(config.rope_interleaved), NORM_KINDS[config.norm],
    ]  # fmt: skip


def layer_kinds(layers: nn.ModuleList, windowed_pool: bool) -> list[int]:
    """Per layer: its window (0: none), its rope (-1 none, 0 global, 1 local), its KV pool (1: the windowed
    layers' own, where windowed_pool)."""
    kinds: list[int] = []
    for layer in layers:
        attention = cast(DecoderLayer, layer).self_attn
        if isinstance(attention, LatentAttention):  # full attention, the global rope, the one pool
            kinds += [0, 0, 0]
            continue
        rope = -1 if not attention.uses_rope else 1 if attention.rope_kind == "local" else 0
        kinds += [attention.window, rope, int(windowed_pool and attention.window > 0)]
    return kinds


def norm_weight(norm: Norm | None) -> torch.Tensor:
    """What the stack's rms_norm takes: the weight, or Gemma's 1 + w in float32; empty for no norm."""
    if norm is None:
        return torch.empty(0)
    if isinstance(norm, OffsetRMSNorm):
        assert norm.scale is not None, "finalize() the model first"
        return norm.scale
    return norm.weight.detach()


def native_weights(layer: DecoderLayer) -> list[torch.Tensor]:
    """One layer's weights in csrc/decoder_cpu.cpp's order; an empty tensor for an absent bias or norm. A
    mixture-of-experts layer's MLP slots hold its shared expert (empty without one), then its own slots;
    latent attention's q (or q_b) product takes qkv's slots, and its own come last."""
    attention, mlp, none = layer.self_attn, layer.mlp, torch.empty(0)
    moe = mlp if isinstance(mlp, SparseMoE) else None
    latent = attention if isinstance(attention, LatentAttention) else None
    linears = stack_products(layer)  # a plain MLP's up product in gate_up's slots
    up, down = linears[2], linears[3]
    qkv = attention.qkv_proj if isinstance(attention, Attention) else attention.q_b_proj or attention.q_proj
    q_norm, k_norm = (
        (attention.q_norm, attention.k_norm) if isinstance(attention, Attention) else (None, None)
    )
    products = (qkv, attention.o_proj, up, down)
    return [
        norm_weight(layer.input_layernorm), weight(qkv), bias(qkv), weight(attention.o_proj),
        norm_weight(layer.post_attention_layernorm), weight(up), weight(down), norm_weight(q_norm),
        norm_weight(k_norm), *(packing(linear) for linear in products), norm_weight(layer.post_attn_norm),
        norm_weight(layer.post_mlp_norm), bias(attention.o_proj), bias(up), bias(down),
        optional(layer.input_layernorm, "bias"), optional(layer.post_attention_layernorm, "bias"),
        *(moe_weights(moe) if moe is not None else [none] * 12),
        attention.sinks.detach().float() if isinstance(attention, Attention) and attention.sinks is not None
        else none,
        *(input_order(linear) for linear in linears),
        *(latent_weights(latent) if latent is not None else [none] * 11),
        *(expert_orders(moe.experts) if moe is not None else (none, none)),
    ]  # fmt: skip


def weight(linear: Linear | None) -> torch.Tensor:
    """A product's weight slot: its weight (oneDNN's packing where packed), or GGUF blocks' parts."""
    if linear is None:
        return torch.empty(0)
    if linear.quant_parts is not None:  # GGUF blocks kept packed: the parts (packing(): the bytes)
        return linear.quant_parts
    return (linear.packed if linear.packed is not None else linear.weight).detach()


def bias(linear: Linear | None) -> torch.Tensor:
    """A product's bias, as wide as its pair packing where that is padded (Linear.pairs_bias)."""
    if linear is None or linear.bias is None:
        return torch.empty(0)
    return (linear.pairs_bias if linear.pairs_bias is not None else linear.bias).detach()


def optional(module: nn.Module | None, name: str) -> torch.Tensor:
    tensor = getattr(module, name, None) if module is not None else None
    return tensor.detach() if tensor is not None else torch.empty(0)


def packing(linear: Linear | None) -> torch.Tensor:
    """csrc's packing of a product: linear_rows' 3-d, linear_amx's 5-d view of the pairs, the pairs 4-d."""
    if linear is None:
        return torch.empty(0)
    if linear.quant_bytes is not None:
        return linear.quant_bytes
    if linear.amx:
        assert linear.pairs is not None
        groups, kpairs, width, two = linear.pairs.shape
        return linear.pairs.view(groups, kpairs // 16, 16, width, two)
    return optional(linear, "rows" if linear.rows is not None else "pairs")


def expert_orders(experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Act-order experts' input orders as expert_loop takes them (Experts.quant_orders), or empties."""
    if experts.quant_orders is None:
        return torch.empty(0), torch.empty(0)
    return experts.quant_orders


def latent_weights(attention: LatentAttention) -> list[torch.Tensor]:
    """Latent attention's own slots: q_a (weight, bias, packing) and its norm, kv_a's and its norm, the
    heads' W_UK^T and W_UV^T packings ([heads, ...]), and [kv_lora_rank, nope, rope, v, q_lora_rank]."""
    assert attention.uk_stack is not None and attention.uv_stack is not None, "finalize() with the kernels"
    q_a, kv_a = attention.q_a_proj, attention.kv_a_proj_with_mqa
    q_rank = q_a.out_features if q_a is not None else 0
    dims = [attention.rank, attention.nope, attention.rope, attention.v_dim, q_rank]
    return [
        weight(q_a), bias(q_a), packing(q_a), norm_weight(attention.q_a_layernorm), weight(kv_a), bias(kv_a),
        packing(kv_a), norm_weight(attention.kv_a_layernorm), attention.uk_stack, attention.uv_stack,
        torch.tensor(dims, dtype=torch.int64),
    ]  # fmt: skip


def stack_products(layer: DecoderLayer) -> tuple[Linear | None, ...]:
    """The layer's products the stack runs with their act-order (qkv, o, the MLP's or shared expert's up or
    gate_up, and down): an act-order product elsewhere (a router) keeps the Python layers."""
    attention, mlp = layer.self_attn, layer.mlp
    dense = mlp.shared_expert if isinstance(mlp, SparseMoE) else mlp
    up = None if dense is None else dense.gate_up_proj if dense.gated else dense.up_proj
    down = None if dense is None else dense.down_proj
    if isinstance(attention, LatentAttention):  # its products take no order on the stack
        return None, None, up, down
    return attention.qkv_proj, attention.o_proj, up, down


def input_order(linear: Linear | None) -> torch.Tensor:
    """An act-order product's input order as the stack takes it: [K] where every part shares it, else
    [parts, K] (a part with none in its natural order); empty for a product without one."""
    if linear is None or not linear.ordered:
        return torch.empty(0)
    if linear.shared_order is not None:
        return linear.shared_order
    assert linear.quant is not None
    natural = torch.arange(linear.in_features, dtype=torch.int64)
    return torch.stack([natural if part.order is None else part.order for part in linear.quant])


def moe_weights(moe: SparseMoE) -> list[torch.Tensor]:
    """A mixture-of-experts layer's slots: router (weight, bias, packing), the experts' packings and biases,
    the shared expert's gate (weight, packing), DeepSeek's score bias, and the router's and experts' numbers
    ([kind, top_k, renormalize, groups, top_groups, activation] and [scaling, alpha, limit])."""
    experts, none = moe.experts, torch.empty(0)
    w13, w2 = experts.w13, experts.w2
    if experts.quantized is not None:  # kept as their blocks: expert_loop' bytes and table
        w13, w2 = experts.quant_bytes, experts.quant_table
    assert w13 is not None and w2 is not None, "pack the experts first"

    def detached(tensor: torch.Tensor | None) -> torch.Tensor:
        return tensor.detach() if tensor is not None else none

    ints = [ROUTERS.index(moe.router), moe.top_k, int(moe.norm_topk_prob), moe.groups, moe.top_groups,
            EXPERT_ACTIVATIONS[experts.act]]  # fmt: skip
    return [
        weight(moe.gate), detached(moe.gate.bias), packing(moe.gate), w13, w2,
        detached(experts.gate_up_proj_bias), detached(experts.down_proj_bias), weight(moe.shared_expert_gate),
        packing(moe.shared_expert_gate), detached(moe.score_bias), torch.tensor(ints, dtype=torch.int64),
        torch.tensor([moe.scaling, experts.alpha, experts.limit], dtype=torch.float64),
    ]  # fmt: skip
