"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm). Either may slide a window over its layers
from max_window_layers on, when use_sliding_window says so (transformers' rule)."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig, layer_types


def _windows(hf: HFConfig) -> dict[str, Any]:
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first = hf.get("max_window_layers", 28)
    kinds = layer_types(
        hf, lambda i: "sliding_attention" if window is not None and i >= first else "full_attention"
    )
    if kinds and not window:
        raise hf.fail(
            "layer_types lists sliding layers but use_sliding_window is off (transformers refuses it)"
        )
    return {"sliding_window": int(window or 0), "layer_types": kinds} if kinds else {}


def qwen2_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, **_windows(hf)}


def qwen3_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"attention_bias": bias, "o_bias": bias, "qk_norm": "head", **_windows(hf)}


QWEN2 = Family(
    "qwen2",
    ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    gguf_architectures=("qwen2",),
    options=qwen2_options,
)
QWEN3 = Family(
    "qwen3",
    ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    gguf_architectures=("qwen3",),
    options=qwen3_options,
    default_rope_theta=1e6,
)
