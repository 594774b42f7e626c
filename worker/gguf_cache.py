"""A model's config and weights, with a GGUF file's conversion kept on disk as safetensors.

Opening SmolLM2's GGUF file (gguf's reader walks each of the 49K vocabulary entries) took 6.2 s and
dequantizing its tensors 3.2 s (AMD EPYC, AVX2 only, 2026-12-01); reading the converted copy back takes
a few tenths of a second. The copy keeps the dequantized float32 values, so a model loaded from it is
the model loaded from the file. An entry is keyed by the file's path, size and modification time and by
CONVERSION_VERSION; it is written to a temporary name and renamed, so a killed start leaves no half
entry and two starts may convert at once. Each entry records its file's path (SOURCE_FILE); writing one removes
the entries of the same path and form made before it (a reinstalled or re-downloaded file has a new
modification time: 25 entries, 7 GB, had piled up on a development machine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator

import torch

from protocol.config import default_cache_dir
from worker.config_files import load_model_config, open_gguf
from worker.model_config import ModelConfig
from worker.quant.blocks import GgufBlocks, QuantWeight
from worker.weights import iterate_weights

logger = logging.getLogger("engine.worker")

# Bump when the conversion changes (names, the rotary permutation, dtypes): older entries are then ignored.
CONVERSION_VERSION = 2
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
SOURCE_FILE = "source.json"  # {"model": the GGUF file's path, "packed": bool}
BLOCKS_FILE = "blocks.json"  # the weights kept as the file's blocks: name -> [GGML type, N, K]

Weights = Iterator[tuple[str, "torch.Tensor | QuantWeight"]]


def load_model_files(model: str, cache_dir: str | None, packed: bool = False) -> tuple[ModelConfig, Weights]:
    """The model's config and an iterator of its (Hugging Face name, tensor) weights; packed: a GGUF file's
    quantized weights come as its blocks (GgufBlocks; --quantization gguf), the rest as float32 tensors."""
    if not model.endswith(".gguf"):
        config = load_model_config(model)
        return config, iterate_weights(model, config, packed=packed)
    entry = _entry_path(model, cache_dir, packed) if cache_dir else None
    if entry is not None and os.path.exists(os.path.join(entry, CONFIG_FILE)):
        try:
            return _read_entry(entry)
        except Exception as error:  # noqa: BLE001 (a truncated file, a changed config: convert again)
            logger.warning("ignoring a broken GGUF conversion at %s: %s", entry, error)
    reader = open_gguf(model)
    config = load_model_config(model, reader)
    if entry is None:
        return config, iterate_weights(model, config, reader, packed=packed)
    weights = dict(iterate_weights(model, config, reader, packed=packed))
    _write_entry(entry, config, weights, {"model": os.path.abspath(model), "packed": packed})
    return config, iter(weights.items())


def _entry_path(model: str, cache_dir: str, packed: bool = False) -> str:
    stat = os.stat(model)
    key = f"{model}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}{':packed' if packed else ''}"
    return os.path.join(cache_dir, "gguf", hashlib.sha256(key.encode()).hexdigest()[:16])


def _read_entry(entry: str) -> tuple[ModelConfig, Weights]:
    from safetensors.torch import load_file

    with open(os.path.join(entry, CONFIG_FILE)) as f:
        config = ModelConfig(**json.load(f))
    weights: dict[str, torch.Tensor | GgufBlocks] = dict(load_file(os.path.join(entry, WEIGHTS_FILE)))
    blocks_path = os.path.join(entry, BLOCKS_FILE)
    if os.path.exists(blocks_path):
        with open(blocks_path) as f:
            for name, (qtype, n, k) in json.load(f).items():
                rows = weights[name]
                assert isinstance(rows, torch.Tensor)
                weights[name] = GgufBlocks(qtype, rows.numpy(), (n, k))
    return config, iter(weights.items())


def _remove_older_entries(entry: str, source: dict[str, object]) -> None:
    """The other entries converted from the same path in the same form: an earlier version of the file."""
    root = os.path.dirname(entry)
    for name in os.listdir(root):
        other = os.path.join(root, name)
        if other == entry or ".tmp" in name:
            continue
        try:
            with open(os.path.join(other, SOURCE_FILE)) as f:
                same = json.load(f) == source
        except (OSError, ValueError):
            continue  # no record (an older entry, another kind of file): left alone
        if same:
            shutil.rmtree(other, ignore_errors=True)


def _write_entry(
    entry: str, config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight], source: dict[str, object]
) -> None:
    from safetensors.torch import save_file

    tmp = f"{entry}.tmp{os.getpid()}"
    blocks = {name: [b.qtype, *b.shape] for name, b in weights.items() if isinstance(b, GgufBlocks)}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, GgufBlocks):
            tensors[name] = torch.tensor(w.rows)  # (a copy: the reader's map is read-only)
        else:
            assert isinstance(w, torch.Tensor), name  # a GGUF file's quantized weights are GgufBlocks
            tensors[name] = w
    try:
        os.makedirs(tmp, exist_ok=True)
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE))
        if blocks:
            with open(os.path.join(tmp, BLOCKS_FILE), "w") as f:
                json.dump(blocks, f)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(dataclasses.asdict(config), f)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump(source, f)
        os.replace(tmp, entry)
        _remove_older_entries(entry, source)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(entry, CONFIG_FILE)):  # not another start's entry: a full disk
            logger.warning("could not keep the GGUF conversion at %s: %s", entry, error)


def main(argv: list[str]) -> int:
    """`python -m worker.gguf_cache MODEL [CACHE_DIR]`: convert a GGUF file's weights and tokenizer now
    (`make install` does it for the default model), so that the first `engine serve` starts in seconds."""
    from structured_outputs.tokenizer import load_tokenizer

    logging.basicConfig(level=logging.INFO)
    model, cache_dir = argv[0], argv[1] if len(argv) > 1 else default_cache_dir()
    if model.endswith(".gguf"):
        load_model_files(model, cache_dir, packed=True)  # as `engine serve` loads it: the blocks kept
        load_tokenizer(model, cache_dir)
        print(f"GGUF conversion of {model} kept in {cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
