"""A model's config and weights, with a GGUF file's conversion kept on disk as safetensors.

Opening SmolLM2's GGUF file (gguf's reader walks each of the 49K vocabulary entries) took 6.2 s and
dequantizing its tensors 3.2 s (AMD EPYC, AVX2 only, 2026-12-01); reading the converted copy back takes
a few tenths of a second. The copy keeps the dequantized float32 values, so a model loaded from it is
the model loaded from the file. An entry is keyed by the file's path, size and modification time and by
CONVERSION_VERSION; it is written to a temporary name and renamed, so a killed start leaves no half
entry and two starts may convert at once.
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
from worker.weights import iterate_weights

logger = logging.getLogger("engine.worker")

# Bump when the conversion changes (names, the rotary permutation, dtypes): older entries are then ignored.
CONVERSION_VERSION = 2
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"

Weights = Iterator[tuple[str, torch.Tensor]]


def load_model_files(model: str, cache_dir: str | None) -> tuple[ModelConfig, Weights]:
    """The model's config and an iterator of its (Hugging Face name, tensor) weights."""
    if not model.endswith(".gguf"):
        config = load_model_config(model)
        return config, iterate_weights(model, config)
    entry = _entry_path(model, cache_dir) if cache_dir else None
    if entry is not None and os.path.exists(os.path.join(entry, CONFIG_FILE)):
        try:
            return _read_entry(entry)
        except Exception as error:  # noqa: BLE001 (a truncated file, a changed config: convert again)
            logger.warning("ignoring a broken GGUF conversion at %s: %s", entry, error)
    reader = open_gguf(model)
    config = load_model_config(model, reader)
    if entry is None:
        return config, iterate_weights(model, config, reader)
    weights = dict(iterate_weights(model, config, reader))
    _write_entry(entry, config, weights)
    return config, iter(weights.items())


def _entry_path(model: str, cache_dir: str) -> str:
    stat = os.stat(model)
    key = f"{model}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}"
    return os.path.join(cache_dir, "gguf", hashlib.sha256(key.encode()).hexdigest()[:16])


def _read_entry(entry: str) -> tuple[ModelConfig, Weights]:
    from safetensors.torch import load_file

    with open(os.path.join(entry, CONFIG_FILE)) as f:
        config = ModelConfig(**json.load(f))
    weights = load_file(os.path.join(entry, WEIGHTS_FILE))
    return config, iter(weights.items())


def _write_entry(entry: str, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = f"{entry}.tmp{os.getpid()}"
    try:
        os.makedirs(tmp, exist_ok=True)
        save_file(weights, os.path.join(tmp, WEIGHTS_FILE))
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(dataclasses.asdict(config), f)
        os.replace(tmp, entry)
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
        load_model_files(model, cache_dir)
        load_tokenizer(model, cache_dir)
        print(f"GGUF conversion of {model} kept in {cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
