"""The mixture-of-experts families: the shared decoder with a SparseMoE in place of the MLP
(worker/models/moe.py) on their sparse layers.

Mixtral: top 2 of 8 by softmax, renormalized, Mistral's attention (and its window, when set). Qwen2-MoE:
Qwen2's attention (q/k/v biases as `qkv_bias` says), a shared expert with a sigmoid gate, top-k weights
renormalized as `norm_topk_prob` says. Qwen3-MoE: Qwen3's attention (per-head q/k norms), no shared expert.
Both Qwens keep a dense MLP on the layers `mlp_only_layers` lists and on those `decoder_sparse_step` skips.
"""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig
from worker.models.families.qwen import qwen2_options, qwen3_options


def experts(hf: HFConfig, **extra: Any) -> dict[str, Any]:
    """The fields every MoE config spells alike (num_experts is num_local_experts or n_routed_experts in
    some)."""
    count = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    if not count:
        raise hf.fail("num_experts is missing or 0")
    hf.refuse("output_router_logits", (False,), "router logits are a training output")
    return {"num_experts": int(count), "num_experts_per_tok": int(hf.get("num_experts_per_tok")), **extra}


def qwen_sparse_layers(hf: HFConfig) -> dict[str, Any]:
    """transformers' rule: layer i is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step."""
    step, only = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers", []))
    if step <= 0:
        raise hf.fail(f"decoder_sparse_step {step} is not a positive step")
    dense = [i for i in range(hf.get("num_hidden_layers")) if i in only or (i + 1) % step]
    return {
        "dense_layers": dense,
        "moe_intermediate_size": int(hf.get("moe_intermediate_size")),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }


def mixtral_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {
        **experts(hf, moe_intermediate_size=common["intermediate_size"], norm_topk_prob=True),
        "sliding_window": int(hf.get("sliding_window", 0)),
    }


def qwen2_moe_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {
        **qwen2_options(hf, common),
        "attention_bias": bool(hf.get("qkv_bias", True)),
        **experts(hf, **qwen_sparse_layers(hf)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 0)),
        "shared_expert_gate": True,
    }


def qwen3_moe_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {**qwen3_options(hf, common), **experts(hf, **qwen_sparse_layers(hf))}


# Mixtral's names onto ours: block_sparse_moe is the MLP, w1 / w3 / w2 the gate / up / down products
MIXTRAL_NAMES = (
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
)

MIXTRAL = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    options=mixtral_options,
    default_rope_theta=1e6,
    renames=MIXTRAL_NAMES,
)
QWEN2_MOE = Family(
    "qwen2_moe", ("Qwen2MoeForCausalLM",), gguf_architectures=("qwen2moe",), options=qwen2_moe_options
)
QWEN3_MOE = Family(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    gguf_architectures=("qwen3moe",),
    options=qwen3_moe_options,
    default_rope_theta=1e6,
)
