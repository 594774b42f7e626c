"""Backends by name (vLLM's `--structured-outputs-config '{"backend": ...}'`), imported lazily."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structured_outputs.base import Backend

BACKENDS = {"guidance": "structured_outputs.guidance:GuidanceBackend"}
AUTO = "guidance"  # chosen by measurement: docs/structured-outputs.md
# vLLM's other names: known, so the error says what to pick instead of "unknown"
NOT_BUILT_IN = ("xgrammar", "outlines", "lm-format-enforcer")


def resolve_backend_name(name: str) -> str:
    """ "auto" -> the default backend; raises ValueError for a backend this build does not have."""
    if name == "auto":
        return AUTO
    if name in NOT_BUILT_IN:
        raise ValueError(
            f"structured outputs backend {name!r} is not built in; choose one of auto, {', '.join(BACKENDS)}"
        )
    if name not in BACKENDS:
        raise ValueError(
            f"unknown structured outputs backend {name!r}; choose one of auto, {', '.join(BACKENDS)}"
        )
    return name


def backend_class(name: str) -> type[Backend]:
    module, _, attribute = BACKENDS[resolve_backend_name(name)].partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module), attribute)
    return cls


def get_backend(name: str, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Backend:
    """A backend bound to one tokenizer (building one takes about half a second: keep it)."""
    return backend_class(name)(hf_tokenizer, vocab_size, eos_token_ids)  # type: ignore[call-arg]
