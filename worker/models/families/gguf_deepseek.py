"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2`): the metadata as our DeepSeek config, and the latent
attention's up-projection put back together. llama.cpp's converter splits `kv_b_proj` per head into
`attn_k_b` (the key's no-rope part, transposed: [heads, kv_lora_rank, nope]) and `attn_v_b` ([heads, v,
kv_lora_rank]); files written before that split keep one `attn_kv_b`, and say so by having no
`key_length_mla`. The router is V3's (sigmoid scores plus `exp_probs_b`, groups by their two best) where the
file's gating function is sigmoid, V2's softmax otherwise (grouped where it has groups)."""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.model_config import UnsupportedModelError
from worker.models.rope import yarn_mscale

GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE as written
DEEPSEEK2_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # written as `.bias`: the whole name here
}


def deepseek2_options(meta: Any, fields: dict[str, Any]) -> dict[str, Any]:
    rope = int(meta.arch_get("rope.dimension_count"))
    rank = int(meta.arch_get("attention.kv_lora_rank", 0) or 0)
    if not rank:
        raise UnsupportedModelError("GGUF deepseek2: attention.kv_lora_rank is missing or 0")
    key = meta.arch_get("attention.key_length_mla") or meta.arch_get("attention.key_length")
    value = meta.arch_get("attention.value_length_mla") or meta.arch_get("attention.value_length")
    gating = int(meta.arch_get("expert_gating_func", 1) or 1)
    if gating not in GATING:
        raise UnsupportedModelError(f"GGUF deepseek2: expert_gating_func {gating} is not supported (1, 2)")
    groups = int(meta.arch_get("expert_group_count", 1) or 1)
    router = (
        "sigmoid_grouped" if GATING[gating] == "sigmoid" else "softmax_grouped" if groups > 1 else "softmax"
    )
    scale = int(key) ** -0.5
    scaling = fields["rope_scaling"]
    if scaling is not None:
        log_mul = meta.arch_get("rope.scaling.yarn_log_multiplier")
        if log_mul:  # the converter wrote 0.1 * mscale_all_dim; llama.cpp's rotary magnitude stays 1
            mscale = float(log_mul) / 0.1
            scaling = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
            scale *= yarn_mscale(float(scaling["factor"]), mscale) ** 2
    width = int(meta.arch_get("expert_feed_forward_length"))
    layers = fields["num_layers"]
    return {
        "num_kv_heads": fields["num_heads"],  # (the file says 1: the latent is shared)
        "head_dim": int(key),
        "rotary_dim": 0,
        "rope_scaling": scaling,
        "kv_lora_rank": rank,
        "q_lora_rank": int(meta.arch_get("attention.q_lora_rank", 0) or 0),
        "qk_nope_head_dim": int(key) - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(value),
        "attention_scale": scale,
        "rope_interleaved": True,  # llama.cpp's NORM rope: adjacent pairs, as transformers' DeepSeek
        "num_experts": int(meta.arch_get("expert_count")),
        "num_experts_per_tok": int(meta.arch_get("expert_used_count")),
        "moe_intermediate_size": width,
        "moe_router": router,
        "norm_topk_prob": bool(meta.arch_get("expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": int(meta.arch_get("expert_group_used_count", 1) or 1),
        "routed_scaling_factor": float(meta.arch_get("expert_weights_scale", 1.0) or 1.0),
        "shared_expert_intermediate_size": int(meta.arch_get("expert_shared_count", 0) or 0) * width,
        "dense_layers": list(range(min(int(meta.arch_get("leading_dense_block_count", 0) or 0), layers))),
    }


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """attn_k_b [heads, rank, nope] and attn_v_b [heads, v, rank] -> kv_b_proj [heads * (nope + v), rank]."""
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [heads, nope + v, rank]
    return np.ascontiguousarray(joined.reshape(-1, joined.shape[-1]))
