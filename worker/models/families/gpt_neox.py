"""GPT-NeoX and Pythia: LayerNorms with biases, a fused query_key_value laid out head by head (q, k, v of
head 0, then of head 1...: reordered into ours at load), partial rotary (rotary_pct of each head), a plain
GELU MLP with biases, and by default attention and MLP in parallel, each with its norm of the same input,
out = (mlp + attn) + x. The output matrix (embed_out) is its own."""

from __future__ import annotations

from typing import Any

import torch

from worker.model_config import ModelConfig
from worker.models.families.base import Family, HFConfig


def neox_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    parallel = bool(hf.get("use_parallel_residual", True))
    head_dim = common["hidden_size"] // common["num_heads"]
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or hf.get("rotary_pct", 0.25)
    rotary = int(head_dim * partial)
    return {
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "mlp_bias": True,
        "attention_bias": bias,
        "o_bias": bias,
        "layout": "parallel" if parallel else "pre",
        "head_dim": head_dim,
        "rotary_dim": 0 if rotary == head_dim else rotary,
        "rms_norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
        "rope_theta": float(
            (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rotary_emb_base", 10000.0)
        ),
    }


def unfuse_heads(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's query_key_value rows [head, (q, k, v), head_dim] -> ours [(q, k, v), head, head_dim]."""
    rows = tensor.shape[0]
    grouped = tensor.reshape(num_heads, 3, rows // num_heads // 3, *tensor.shape[1:])
    return grouped.transpose(0, 1).reshape(tensor.shape)


def neox_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    return unfuse_heads(tensor, config.num_heads) if ".qkv_proj." in name else tensor


GPT_NEOX = Family(
    "gpt_neox",
    ("GPTNeoXForCausalLM",),
    gguf_architectures=("gptneox",),
    options=neox_options,
    convert=neox_tensor,
    renames=(
        (r"^gpt_neox\.", "model."),
        (r"^model\.embed_in\.", "model.embed_tokens."),
        (r"^model\.final_layer_norm\.", "model.norm."),
        (r"^embed_out\.", "lm_head."),
        (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
        (r"\.attention\.dense\.", ".self_attn.o_proj."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
    ),
)
