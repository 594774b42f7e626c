"""GLM (glm-4-9b-*-hf) and GLM-4 (0414): q/k/v biases (no o bias), a fused gate_up_proj, half the head
rotating as adjacent pairs (2i, 2i + 1); GLM-4 adds the sandwich norms (post_self_attn_layernorm,
post_mlp_layernorm)."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig


def glm_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    explicit = hf.has("partial_rotary_factor") or "partial_rotary_factor" in (hf.get("rope_parameters") or {})
    rotary = common["rotary_dim"] if explicit else common["head_dim"] // 2  # GlmConfig's default: half
    return {
        "attention_bias": bool(hf.get("attention_bias", True)),
        "rope_interleaved": True,
        "rotary_dim": rotary,
    }


def glm4_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {**glm_options(hf, common), "layout": "sandwich"}


GLM = Family("glm", ("GlmForCausalLM",), options=glm_options)
GLM4 = Family(
    "glm4",
    ("Glm4ForCausalLM",),
    gguf_architectures=("glm4",),
    options=glm4_options,
    renames=(
        (r"\.post_self_attn_layernorm\.", ".post_attn_norm."),
        (r"\.post_mlp_layernorm\.", ".post_mlp_norm."),
    ),
)
