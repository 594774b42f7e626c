"""gpt-oss GGUF files (llama.cpp's `gpt-oss`): the metadata as our gpt-oss config, the experts' MXFP4 blocks
in the checkpoints' layout, and the gate and up biases joined back.

llama.cpp's converter writes each expert's gate and up apart (`ffn_gate_exps`, `ffn_up_exps` [experts, I, H],
de-interleaved from the checkpoint's `gate_up_proj`), their biases apart, and MXFP4 blocks as llama.cpp's
17 bytes (the E8M0 scale, then 16 bytes holding value j in the low nibble of byte j and value j + 16 in
its high one; a checkpoint holds values 2m and 2m + 1 in byte m). It writes no layer pattern, SwiGLU
alpha or limit: llama.cpp hard-codes sliding windows on the even layers, 1.702 and 7.0, which are also
transformers' defaults. YaRN is not truncated, as transformers' gpt-oss runs it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from worker.quant.blocks import Mxfp4Blocks

MXFP4 = 39  # GGMLQuantizationType.MXFP4
GPT_OSS_NAMES = {"attn_sinks": "self_attn.sinks"}  # written as `.weight`: the whole name here


def gpt_oss_options(meta: Any, fields: dict[str, Any]) -> dict[str, Any]:
    scaling = fields["rope_scaling"]
    layers = fields["num_layers"]
    return {
        "attention_bias": True,
        "o_bias": True,
        "attention_sinks": True,
        "sliding_window": int(meta.arch_get("attention.sliding_window", 0) or 0),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "num_experts": int(meta.arch_get("expert_count")),
        "num_experts_per_tok": int(meta.arch_get("expert_used_count")),
        "moe_intermediate_size": int(meta.arch_get("expert_feed_forward_length")),
        "moe_router": "topk_softmax",
        "router_bias": True,
        "expert_bias": True,
        "moe_act": "swiglu_clamped",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "rope_scaling": {**scaling, "truncate": False} if scaling else None,
    }


def join_gate_up_bias(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ffn_gate_exps.bias and ffn_up_exps.bias [experts, I] -> the checkpoint's gate_up_proj_bias [experts,
    2I], gate at the even columns."""
    return np.ascontiguousarray(np.stack([gate, up], axis=-1).reshape(gate.shape[0], -1))


def mxfp4_experts(name: str, raw: np.ndarray, shape: tuple[int, ...]) -> Iterator[tuple[str, Mxfp4Blocks]]:
    """A stacked MXFP4 expert tensor `...experts.<part>.weight` (raw uint8 [experts, rows, groups * 17],
    shape [experts, rows, cols]) -> each expert's product as the checkpoints hold its blocks."""
    experts, rows, cols = shape
    stacked = raw.reshape(experts, rows, cols // 32, 17)
    scales, quads = stacked[..., 0], stacked[..., 1:]
    codes = np.concatenate([quads & 0x0F, quads >> 4], axis=-1)  # [.., 32]: values 0-15, then 16-31
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # byte m: values 2m, 2m + 1
    stem, _, part = name.rpartition(".experts.")
    for expert in range(experts):
        yield (
            f"{stem}.experts.{expert}.{part}",
            Mxfp4Blocks(np.ascontiguousarray(blocks[expert]), np.ascontiguousarray(scales[expert])),
        )
