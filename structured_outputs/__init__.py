"""Grammar backends for structured outputs: a spec (protocol.StructuredOutputsParams) becomes a token
matcher. The frontend imports this to validate a spec before sending it; the worker, to compile and
match. Imports protocol/, numpy and the grammar libraries; never torch, never frontend/ or worker/.
"""

from structured_outputs.base import Backend, GrammarCompileError, Matcher
from structured_outputs.registry import BACKENDS, backend_class, get_backend, resolve_backend_name

__all__ = [
    "BACKENDS",
    "Backend",
    "GrammarCompileError",
    "Matcher",
    "backend_class",
    "get_backend",
    "resolve_backend_name",
]
