"""Phi-3, Phi-3.5 and Phi-4-mini: fused qkv_proj and gate_up_proj checkpoints (our own layout), partial
rotary (Phi-4-mini rotates 96 of 128 dims), LongRoPE's short and long factors, and a sliding window over
every layer when the config has one (Phi-3-mini-4k's 2047)."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig


def phi3_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    scaling = common["rope_scaling"]
    if scaling is not None and scaling["rope_type"] not in ("longrope", "yarn"):
        raise hf.fail(f"rope type {scaling['rope_type']!r}: Phi-3 takes default and longrope only")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling = {**scaling, "rope_type": "longrope"}  # Phi3Config rewrites "yarn" (and "su") to longrope
    return {"rope_scaling": scaling, "sliding_window": int(hf.get("sliding_window", 0) or 0)}


PHI3 = Family("phi3", ("Phi3ForCausalLM",), gguf_architectures=("phi3",), options=phi3_options)
