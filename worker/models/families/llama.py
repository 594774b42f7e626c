"""Llama 2/3, SmolLM2, TinyLlama and Mistral: the shared decoder as it is, with biases where
`attention_bias` (q, k, v and o) and `mlp_bias` ask, and Mistral's sliding window over every layer."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig


def llama_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"attention_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}


def mistral_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    # MistralConfig's class default is a 4096-token window: a config.json without the key has one
    window = hf.values["sliding_window"] if "sliding_window" in hf.values else 4096
    return {**llama_options(hf, common), "sliding_window": int(window or 0)}


LLAMA = Family(
    "llama",
    ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    gguf_architectures=("llama", "mistral"),
    options=llama_options,
)
MISTRAL = Family(
    "mistral", ("MistralForCausalLM", "MistralForSequenceClassification"), options=mistral_options
)
