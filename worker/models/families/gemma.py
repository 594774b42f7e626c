"""Gemma, Gemma 2 and Gemma 3 (text; and the language model of Gemma3ForConditionalGeneration).

All three: (1 + w) RMSNorms in float32, embeddings times float32(sqrt(hidden)), a GELU (tanh) gated MLP,
tied embeddings. Gemma 2 adds the sandwich norms, a query scale of query_pre_attn_scalar ** -0.5,
soft-capped attention scores and logits, and a sliding window on even layers. Gemma 3 drops the
soft-capping (transformers never passes attn_logit_softcapping to its attention), adds per-head q/k
norms, and gives its sliding layers (five in six) a rope base of their own, unscaled.
"""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig, embedding_scale, layer_types, rope_parameters

# Gemma 2's checkpoint names onto ours: its post_attention_layernorm norms the attention's output, and its
# pre_feedforward_layernorm is the norm before the MLP (ours: post_attention_layernorm, as in Llama)
SANDWICH = (
    (r"\.post_attention_layernorm\.", ".post_attn_norm."),
    (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".post_mlp_norm."),
)


def gemma_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    hf.refuse("use_bidirectional_attention", (False,), "bidirectional attention (EmbeddingGemma)")
    act = common["hidden_act"]
    if hf.architecture.startswith("GemmaFor") and act == "gelu":
        act = "gelu_tanh"  # GemmaConfig rewrites "gelu" to the tanh approximation
    bias = bool(hf.get("attention_bias", False))
    return {
        "norm": "rms_offset",
        "embedding_multiplier": embedding_scale(common["hidden_size"]),
        "hidden_act": act,
        "attention_bias": bias,
        "o_bias": bias,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def gemma2_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    window = hf.values.get("sliding_window", 4096)
    return {
        **gemma_options(hf, common),
        "layout": "sandwich",
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_softcap": float(hf.values.get("attn_logit_softcapping", 50.0) or 0.0),
        "final_softcap": float(hf.values.get("final_logit_softcapping", 30.0) or 0.0),
        "sliding_window": int(window or 0),
        "layer_types": layer_types(hf, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention"),
    }


def gemma3_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    pattern = hf.get("sliding_window_pattern", 6)
    local_theta, local_scaling, _ = rope_parameters(hf, 10000.0, "sliding_attention")
    if not isinstance(hf.get("rope_parameters"), dict) or "sliding_attention" not in hf.get(
        "rope_parameters"
    ):
        local_theta, local_scaling = float(hf.get("rope_local_base_freq", 10000.0)), None
    if local_scaling is not None:
        raise hf.fail("a scaled rope on the sliding layers is not supported")
    window = hf.values.get("sliding_window", 4096)
    generates_whole = hf.architecture == "Gemma3ForCausalLM"  # the VLM class never soft-caps its logits
    return {
        **gemma_options(hf, common),
        "layout": "sandwich",
        "qk_norm": "head",
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_softcap": float(hf.get("final_logit_softcapping", 0.0) or 0.0) if generates_whole else 0.0,
        "sliding_window": int(window or 0),
        "layer_types": layer_types(
            hf, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"
        ),
        "rope_local_theta": local_theta,
    }


GEMMA = Family(
    "gemma",
    ("GemmaForCausalLM",),
    gguf_architectures=("gemma",),
    options=gemma_options,
    gguf_names={"ffn_norm": "post_attention_layernorm"},
)
GEMMA2 = Family(
    "gemma2", ("Gemma2ForCausalLM",), gguf_architectures=("gemma2",), options=gemma2_options, renames=SANDWICH
)
GEMMA3 = Family(
    "gemma3",
    ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    gguf_architectures=("gemma3",),
    options=gemma3_options,
    default_rope_theta=1e6,
    renames=SANDWICH,
)
