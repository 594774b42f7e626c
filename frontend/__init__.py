"""API servers and the offline API. Imports protocol and the tokenizer stack, never engine_core or worker.

The offline API's names load on first use, so that `engine serve` and each API server import only what
they run.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.offline.llm import LLM
    from frontend.offline.lora import LoRARequest
    from frontend.offline.outputs import CompletionOutput, Logprob, RequestResult
    from protocol.sampling import SamplingParams
    from protocol.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "LoRARequest",
    "CompletionOutput",
    "Logprob",
    "RequestResult",
    "SamplingParams",
    "StructuredOutputsParams",
]

_HOMES = {
    "LLM": "frontend.offline.llm",
    "LoRARequest": "frontend.offline.lora",
    "CompletionOutput": "frontend.offline.outputs",
    "Logprob": "frontend.offline.outputs",
    "RequestResult": "frontend.offline.outputs",
    "SamplingParams": "protocol.sampling",
    "StructuredOutputsParams": "protocol.structured_outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'frontend' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
