"""Granite: Llama with four multipliers: the embeddings' (embedding_multiplier), each branch's output
before its residual add (residual_multiplier), the query scale in place of 1/sqrt(head_dim)
(attention_multiplier) and the logits' divisor (logits_scaling)."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig
from worker.models.families.llama import llama_options


def granite_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {
        **llama_options(hf, common),
        "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "attention_scale": float(hf.get("attention_multiplier", 1.0)),
        "logits_scale": 1.0 / float(hf.get("logits_scaling", 1.0)),
    }


GRANITE = Family("granite", ("GraniteForCausalLM",), gguf_architectures=("granite",), options=granite_options)
