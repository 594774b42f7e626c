"""API servers and the offline API. Imports protocol and the tokenizer stack, never engine_core or worker."""

from frontend.offline.llm import LLM
from frontend.offline.outputs import CompletionOutput, Logprob, RequestResult
from protocol.sampling import SamplingParams
from protocol.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestResult", "SamplingParams", "StructuredOutputsParams"]
