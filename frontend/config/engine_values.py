"""How the values of EngineArgs' flags are read where `option()`'s parsers are not enough: JSON objects,
--lora-modules entries, GiB, and the KV cache's size from the environment (vLLM's CPU variable)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from frontend.config.flags import env_number
from protocol.lora import LoraAdapter

DEFAULT_KV_CACHE_BYTES = 1 << 30
# GiB of KV cache when --kv-cache-memory-bytes is not given; the first one set wins, 0 means the default
# (VLLM_CPU_KVCACHE_SPACE is vLLM's CPU variable: whole GiB there, any positive number here)
KV_CACHE_SPACE_ENV = ("ENGINE_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")


def json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def lora_module(text: str) -> LoraAdapter:
    """One --lora-modules entry, vLLM's two spellings: name=path, or {"name", "path", "base_model_name"}."""
    if text.lstrip().startswith("{"):
        try:
            return msgspec.json.decode(text, type=LoraAdapter, strict=True)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            raise ValueError(f"{error} (its keys: name, path, base_model_name)") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected name=path or a JSON object, got {text!r}")
    return LoraAdapter(name=name, path=path)


def gib(text: str) -> int:
    return int(float(text) * (1 << 30))


def kv_cache_space_from_env(environ: Mapping[str, str]) -> int | None:
    """Bytes from the first of KV_CACHE_SPACE_ENV that is set (GiB), or None (unset or 0: the default)."""
    space = env_number(environ, KV_CACHE_SPACE_ENV, zero_is_unset=True)
    return None if space is None else max(int(space * (1 << 30)), 1)
