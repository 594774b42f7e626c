"""Results of the offline API, shaped like vLLM's so that code moving over reads the same fields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: chosen token first, then top-k
    cumulative_logprob: float | None = None


@dataclass
class RequestResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None for the first prompt token
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
