"""Weight iterators: (Hugging Face parameter name, tensor) from safetensors folders or GGUF files."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from worker.config_files import open_gguf
from worker.model_config import ModelConfig, UnsupportedModelError

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def iterate_weights(
    model: str, config: ModelConfig, gguf_reader: Any = None, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    if model.endswith(".gguf"):
        yield from _iterate_gguf(gguf_reader or open_gguf(model), config, progress)
    else:
        yield from _iterate_safetensors(model, progress)


def _iterate_safetensors(folder: str, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise UnsupportedModelError(f"{folder!r} has no .safetensors weights")
    for path in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _iterate_gguf(reader: Any, config: ModelConfig, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", disable=not progress):
        name = _gguf_to_hf_name(tensor.name)
        if name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)  # [out, in] for matrices, float32
        if config.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            num_heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            weights = _undo_llama_cpp_rope_permute(weights, num_heads)
        yield name, torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy


def _gguf_to_hf_name(name: str) -> str | None:
    if match := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        layer, part, kind = match.groups()
        hf = _GGUF_LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    if match := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        part, kind = match.groups()
        hf = _GGUF_GLOBAL_NAMES.get(part)
        return None if hf is None else f"{hf}.{kind}"
    return None


def _undo_llama_cpp_rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves; restore HF's half-split order."""
    head_dim_half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, head_dim_half, 2, *weights.shape[1:])  # [heads, half, 2, in]
    return w.swapaxes(1, 2).reshape(weights.shape)
