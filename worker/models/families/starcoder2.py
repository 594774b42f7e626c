"""StarCoder2: LayerNorms with biases, a plain GELU (tanh) MLP (c_fc, c_proj), biases on every product
(use_bias), and a sliding window over every layer when the config has one."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig


def starcoder2_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("use_bias", True))
    return {
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "attention_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "rms_norm_eps": float(hf.get("norm_epsilon", 1e-5)),
        "sliding_window": int(hf.get("sliding_window", 0) or 0),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


STARCODER2 = Family(
    "starcoder2",
    ("Starcoder2ForCausalLM",),
    gguf_architectures=("starcoder2",),
    options=starcoder2_options,
    renames=((r"\.mlp\.c_fc\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj.")),
)
