"""Weight iterators: (Hugging Face parameter name, tensor) from safetensors folders or GGUF files."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from worker.config_files import open_gguf
from worker.model_config import ModelConfig, UnsupportedModelError
from worker.quant.blocks import QuantWeight


def iterate_weights(
    model: str, config: ModelConfig, gguf_reader: Any = None, progress: bool = True, packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """packed: a GGUF file's quantized weights as its blocks (worker/models/families/gguf.py), an AWQ, GPTQ
    or compressed-tensors checkpoint's as its integers (worker/quant/formats.py); else dequantized."""
    if model.endswith(".gguf"):
        yield from _iterate_gguf(gguf_reader or open_gguf(model), config, progress, packed)
        return
    from worker.quant.method import INTEGER, quantization_config

    quantization = quantization_config(model) or {}
    if quantization.get("quant_method") not in INTEGER:
        yield from _iterate_safetensors(model, progress)
        return
    from worker.quant.formats import quantized_weights, read_format

    files = _safetensors_files(model)
    names = {name for path in files for name in _names(path)}
    for name, tensor in quantized_weights(
        _iterate_safetensors(model, progress), names, read_format(quantization)
    ):
        yield name, (tensor.dequantize() if isinstance(tensor, QuantWeight) and not packed else tensor)


def _names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def _safetensors_files(folder: str) -> list[str]:
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise UnsupportedModelError(f"{folder!r} has no .safetensors weights")
    return files


def _iterate_safetensors(folder: str, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _safetensors_files(folder)
    for path in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _iterate_gguf(
    reader: Any, config: ModelConfig, progress: bool, packed: bool
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    from worker.models.families.gguf import gguf_tensors

    yield from gguf_tensors(reader, config, progress, packed)
