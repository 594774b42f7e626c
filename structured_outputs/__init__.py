"""Grammar backends for structured outputs: a spec (protocol.StructuredOutputsParams) becomes a token
matcher. The frontend imports this to validate a spec before sending it; the worker, to compile and
match. Imports protocol/, numpy and the grammar libraries; never torch, never frontend/ or worker/.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structured_outputs.base import Backend, GrammarCompileError, Matcher
    from structured_outputs.registry import BACKENDS, backend_class, get_backend, resolve_backend_name

# Imported on first use: the launcher reads backend names (registry) without numpy (base).
_HOMES = {
    "Backend": "base", "GrammarCompileError": "base", "Matcher": "base",
    "BACKENDS": "registry", "backend_class": "registry", "get_backend": "registry",
    "resolve_backend_name": "registry",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'structured_outputs' has no attribute {name!r}")
    return getattr(importlib.import_module(f"structured_outputs.{_HOMES[name]}"), name)


__all__ = [
    "BACKENDS",
    "Backend",
    "GrammarCompileError",
    "Matcher",
    "backend_class",
    "get_backend",
    "resolve_backend_name",
]
