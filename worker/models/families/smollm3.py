"""SmolLM3: Llama with NoPE layers, which skip rotary (no_rope_layers[i] == 0; by default every fourth),
and, when use_sliding_window, a window on those layers alone."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig, layer_types
from worker.models.families.llama import llama_options


def smollm3_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    num_layers = common["num_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(uses_rope) != num_layers:
        raise hf.fail(f"no_rope_layers has {len(uses_rope)} entries for {num_layers} layers")
    nope = [i for i, flag in enumerate(uses_rope) if not flag]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    kinds = layer_types(
        hf, lambda i: "sliding_attention" if window and not uses_rope[i] else "full_attention"
    )
    return {
        **llama_options(hf, common),
        "nope_layers": nope,
        "sliding_window": int(window or 0) if kinds else 0,
        "layer_types": kinds,
    }


SMOLLM3 = Family(
    "smollm3", ("SmolLM3ForCausalLM",), gguf_architectures=("smollm3",), options=smollm3_options,
    default_rope_theta=2_000_000.0,
)  # fmt: skip
