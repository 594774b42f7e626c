"""OLMo 2 and OLMo 3: no norm before attention or MLP; their outputs normed instead (post_attention_layernorm,
post_feedforward_layernorm), and q and k RMS-normed over the whole projection before rotary. OLMo 3 slides
a window over three layers in four, whose rope is the plain one (a YaRN scaling is the full layers')."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig, layer_types, rope_parameters

POST_NORMS = (
    (r"\.post_attention_layernorm\.", ".post_attn_norm."),
    (r"\.post_feedforward_layernorm\.", ".post_mlp_norm."),
)


def olmo2_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"layout": "post", "qk_norm": "proj", "attention_bias": bias, "o_bias": bias}


def olmo3_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    local_theta, local_scaling, _ = rope_parameters(hf, 500000.0, "sliding_attention")
    if local_scaling is not None:
        raise hf.fail("a scaled rope on the sliding layers is not supported")
    window = hf.values.get("sliding_window", 4096)
    kinds = layer_types(hf, lambda i: "sliding_attention" if (i + 1) % 4 else "full_attention")
    return {
        **olmo2_options(hf, common),
        "sliding_window": int(window or 0),
        "layer_types": kinds,
        "rope_local_theta": local_theta if common["rope_scaling"] else 0.0,
    }


OLMO2 = Family(
    "olmo2", ("Olmo2ForCausalLM",), gguf_architectures=("olmo2",), options=olmo2_options, renames=POST_NORMS
)
OLMO3 = Family(
    "olmo3", ("Olmo3ForCausalLM",), options=olmo3_options, default_rope_theta=500000.0, renames=POST_NORMS
)
