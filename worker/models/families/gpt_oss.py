"""gpt-oss (GptOssForCausalLM): the shared decoder with biases on q, k, v and o, attention sinks, sliding and
full attention alternating (`layer_types`), YaRN rope, and a mixture of experts on every layer: the router
(with a bias) softmaxes its top-k logits, each expert's gated MLP has biases and the clamped SwiGLU,
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).

Its checkpoints hold every expert in one tensor, x @ W-oriented and with gate and up interleaved
([E, H, 2I], gate at the even columns): turned into ours ([E, 2I, H], gate rows first) at load. Real
checkpoints ship those tensors as MXFP4 blocks and scales (worker/models/mxfp4.py): kept packed as each
expert's products where the worker keeps quantized weights packed (csrc/quant_blocks.h's MXFP4), else
dequantized here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from worker.model_config import ModelConfig
from worker.models.families.base import Family, HFConfig, layer_types
from worker.models.families.moe import experts
from worker.models.mxfp4 import dequantize_mxfp4
from worker.quant.blocks import Mxfp4Blocks


def gpt_oss_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    quantization = hf.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise hf.fail(f"quantization_config {quantization.get('quant_method')!r}: gpt-oss loads mxfp4 only")
    window = hf.get("sliding_window", 128)
    return {
        "attention_bias": bool(hf.get("attention_bias", True)),
        "o_bias": bool(hf.get("attention_bias", True)),
        "attention_sinks": True,
        "sliding_window": int(window or 0),
        "layer_types": layer_types(hf, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"),
        **experts(hf, moe_intermediate_size=common["intermediate_size"]),
        "moe_router": "topk_softmax",
        "router_bias": True,
        "expert_bias": True,
        "moe_act": "swiglu_clamped",
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def _gate_rows_first(tensor: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved -> [..., 2I] with the gate's I first."""
    return torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)


def convert(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] -> [E, 2I, H]
        return _gate_rows_first(tensor).transpose(1, 2)
    if name.endswith("experts.gate_up_proj_bias"):
        return _gate_rows_first(tensor)
    if name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return tensor.transpose(1, 2)
    return tensor


def combine(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | Mxfp4Blocks]]:
    """MXFP4 `<name>_blocks` and `<name>_scales` (in either order) -> `<name>` in the checkpoint's orientation
    ([E, H, 2I], [E, I, H]), in bf16, which holds every MXFP4 value exactly; packed: each expert's gate, up
    and down as their blocks instead (Mxfp4Blocks, gate rows first). Every other tensor as it is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales") or ".experts." not in name:
            yield name, tensor
            continue
        halves = pending.setdefault(base, {})
        halves[part] = tensor
        if len(halves) == 2:
            del pending[base]
            if packed:
                yield from _expert_blocks(base, halves["blocks"].numpy(), halves["scales"].numpy())
            else:
                yield (
                    base,
                    dequantize_mxfp4(halves["blocks"], halves["scales"], torch.bfloat16).transpose(1, 2),
                )
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)[:3]}")


def _expert_blocks(base: str, blocks: np.ndarray, scales: np.ndarray) -> Iterator[tuple[str, Mxfp4Blocks]]:
    """`...experts.gate_up_proj` [E, 2I, H / 32, 16] (gate and up rows interleaved) or `...experts.down_proj`
    -> each expert's products by HF's per-expert names."""
    stem, _, kind = base.rpartition(".")
    for expert in range(blocks.shape[0]):
        if kind == "gate_up_proj":
            for part, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                yield (
                    f"{stem}.{expert}.{part}.weight",
                    Mxfp4Blocks(
                        np.ascontiguousarray(blocks[expert, rows]), np.ascontiguousarray(scales[expert, rows])
                    ),
                )
        else:
            yield f"{stem}.{expert}.{kind}.weight", Mxfp4Blocks(blocks[expert], scales[expert])


GPT_OSS = Family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    gguf_architectures=("gpt-oss",),  # worker/models/families/gguf_gpt_oss.py
    options=gpt_oss_options,
    default_rope_theta=150000.0,
    renames=((r"\.mlp\.router\.", ".mlp.gate."),),
    convert=convert,
    combine=combine,
)
