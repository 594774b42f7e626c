"""Where a model's Hugging Face tokenizer comes from. The frontend tokenizes with it; the worker builds its
grammar backend's token trie from it (structured outputs)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

logger = logging.getLogger("engine.tokenizer")

# What AutoTokenizer maps these names to is transformers' TokenizersBackend itself (transformers 5).
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model: str, cache_dir: str | None) -> Any | None:
    """The model's Hugging Face tokenizer, or None when the model folder has none.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept in cache_dir,
    keyed by the file's path, size and modification time.
    """
    if not model.endswith(".gguf"):
        try:
            return _from_folder(model)
        except (OSError, ValueError, TypeError) as error:
            logger.warning("no tokenizer in %s (%s): token-id prompts only", model, error)
            return None
    stat = os.stat(model)
    key = hashlib.sha256(f"{model}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir, "tokenizers", key) if cache_dir else None
    if cached and os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return _from_folder(cached)
        except (OSError, ValueError) as error:
            logger.warning("ignoring a broken tokenizer cache at %s: %s", cached, error)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    if cached:
        try:
            tmp = f"{cached}.tmp{os.getpid()}"
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, cached)
        except OSError as error:
            logger.warning("could not cache the tokenizer at %s: %s", cached, error)
    return tokenizer


def _from_folder(folder: str) -> Any:
    """AutoTokenizer's choice. NOTE: a folder whose tokenizer_config.json names the plain tokenizers-backed
    class (every converted GGUF tokenizer does) loads that class directly: AutoTokenizer's import pulls in
    torch, 3.6 s of an API server's start against 1.5 s (AMD EPYC, 2026-12-01)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        tokenizer_class = None
    if tokenizer_class in PLAIN_TOKENIZER_CLASSES:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
