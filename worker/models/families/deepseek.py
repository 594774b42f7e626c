"""DeepSeek-V2 and -V3 (and their distillations' shapes): multi-head latent attention (worker/models/mla.py)
and a mixture of experts after the first `first_k_dense_replace` dense layers, with shared experts
(`n_shared_experts` of the experts' width, ungated) and grouped routing (worker/models/moe.py):

- V2: softmax scores, `topk_method` "greedy" (the top k of all) or "group_limited_greedy" (the best
  `topk_group` of `n_group` groups by their best score); weights times `routed_scaling_factor`, never
  renormalized (transformers' V2 does not read `norm_topk_prob`: set, it is refused).
- V3: sigmoid scores chosen by score plus `e_score_correction_bias`, groups ranked by their two best; the
  chosen weighed by their scores, renormalized where `norm_topk_prob`, times `routed_scaling_factor`.

Rotary covers the rope part of each head only (`qk_rope_head_dim`), on adjacent pairs (V2 always, V3 where
`rope_interleave`); YaRN's `mscale_all_dim` scales the query as transformers' yarn_apply_mscale does.
"""

from __future__ import annotations

from typing import Any

from worker.models.families.base import Family, HFConfig
from worker.models.families.moe import experts
from worker.models.rope import yarn_mscale


def deepseek_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    v3 = hf.architecture.startswith("DeepseekV3")
    nope, rope, rank = hf.get("qk_nope_head_dim"), hf.get("qk_rope_head_dim"), hf.get("kv_lora_rank")
    if not rank:
        raise hf.fail("kv_lora_rank is missing or 0 (multi-head latent attention needs it)")
    hf.refuse("moe_layer_freq", (1,), "experts on every layer after first_k_dense_replace only")
    scale = (nope + rope) ** -0.5
    scaling = common["rope_scaling"] or {}
    if scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    if v3:
        hf.refuse("topk_method", ("noaux_tc",), "V3 routes by sigmoid scores and their correction bias")
        router = {"moe_router": "sigmoid_grouped", "norm_topk_prob": bool(hf.get("norm_topk_prob", True))}
        interleaved = bool(hf.get("rope_interleave", True))
    else:
        hf.refuse(
            "norm_topk_prob", (False,), "transformers' DeepSeek-V2 never renormalizes the top-k weights"
        )
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise hf.fail(
                f"topk_method {method!r} is not supported; supported: 'greedy', 'group_limited_greedy'"
            )
        router = {"moe_router": "softmax_grouped" if method == "group_limited_greedy" else "softmax",
                  "norm_topk_prob": False}  # fmt: skip
        interleaved = True
    shared = int(hf.get("n_shared_experts", 0) or 0)
    moe_width = int(hf.get("moe_intermediate_size"))
    first_dense = int(hf.get("first_k_dense_replace", 0))
    return {
        "head_dim": nope + rope,
        "kv_lora_rank": int(rank),
        "q_lora_rank": int(hf.get("q_lora_rank", 0) or 0),
        "qk_nope_head_dim": int(nope),
        "qk_rope_head_dim": int(rope),
        "v_head_dim": int(hf.get("v_head_dim")),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "attention_scale": scale,
        "rope_interleaved": interleaved,
        **experts(hf, moe_intermediate_size=moe_width, **router),
        "n_group": int(hf.get("n_group", 1) or 1),
        "topk_group": int(hf.get("topk_group", 1) or 1),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "shared_expert_intermediate_size": shared * moe_width,
        "dense_layers": list(range(min(first_dense, common["num_layers"]))),
    }


DEEPSEEK_NAMES = (
    (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.score_bias"),
)
DEEPSEEK = Family(
    "deepseek",
    ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    gguf_architectures=("deepseek2",),  # worker/models/families/gguf_deepseek.py
    options=deepseek_options,
    renames=DEEPSEEK_NAMES,
)
