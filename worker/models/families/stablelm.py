"""StableLM: LayerNorms with biases, partial rotary (a quarter of each head by default), q/k/v biases
(use_qkv_bias), per-head bias-free q/k LayerNorms (qk_layernorm), and with use_parallel_residual one norm
for attention and MLP, out = (x + attn) + mlp."""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig


def stablelm_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor") or hf.get("partial_rotary_factor", 0.25)
    rotary = int(common["head_dim"] * partial)
    return {
        "norm": "layer",
        "norm_bias": True,
        "attention_bias": bool(hf.get("use_qkv_bias", False)),
        "qk_norm": "head_each" if hf.get("qk_layernorm", False) else "",
        "layout": "parallel_shared" if hf.get("use_parallel_residual", False) else "pre",
        "rotary_dim": 0 if rotary == common["head_dim"] else rotary,
        "rms_norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
    }


STABLELM = Family(
    "stablelm",
    ("StableLmForCausalLM",),
    gguf_architectures=("stablelm",),
    options=stablelm_options,
    # the per-head norms' weights are rows of our [heads, head_dim] ones ("#h": row h of the tensor)
    renames=((r"\.(q|k)_layernorm\.norms\.(\d+)\.weight$", r".\1_norm.weight#\2"),),
)
