"""Command R (CohereForCausalLM): one LayerNorm (Cohere's float32 formula, no bias) feeds attention and
MLP in parallel, out = (x + attn) + mlp; rotary over adjacent pairs; logits times logit_scale; optional
per-head q/k LayerNorms (Command R+)."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig


def cohere_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    if common["rope_scaling"] is not None or common["rotary_dim"]:
        raise hf.fail("a scaled or partial rope is not supported for Command R")
    bias = bool(hf.get("attention_bias", False))
    return {
        "norm": "cohere",
        "layout": "parallel_shared",
        "rope_interleaved": True,
        "logits_scale": float(hf.get("logit_scale", 0.0625)),
        "qk_norm": "head_each" if hf.get("use_qk_norm", False) else "",
        "attention_bias": bias,
        "o_bias": bias,
        "rms_norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


COHERE = Family(
    "cohere", ("CohereForCausalLM",), gguf_architectures=("command-r",), options=cohere_options,
    default_rope_theta=500000.0,
)  # fmt: skip
