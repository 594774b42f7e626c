"""Shaping outputs the way the OpenAI API (and its SDK) expects: logprobs, usage, SSE frames."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import Logprobs

_encoder = msgspec.json.Encoder()


def sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenText:
    """Token id -> its text, as shown in logprobs (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, as_id: bool = False) -> str:
        if as_id:  # return_tokens_as_token_ids: vLLM's "token_id:N", for tokens that are not valid UTF-8
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"<{token_id}>"
            self._cache[token_id] = text
        return text


def chat_logprobs(
    logprobs: Logprobs, num_top: int, text: TokenText, as_ids: bool = False
) -> list[dict[str, Any]]:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]} entries."""
    entries = []
    for ids, values in zip(logprobs.token_ids, logprobs.logprobs, strict=True):
        token = text(ids[0], as_ids)
        entries.append(
            {
                "token": token,
                "logprob": _finite(values[0]),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": text(t, as_ids), "logprob": _finite(v), "bytes": list(text(t, as_ids).encode())}
                    for t, v in zip(ids[1 : 1 + num_top], values[1 : 1 + num_top], strict=True)
                ],
            }
        )
    return entries


class CompletionLogprobs:
    """Completions shape, built up over a choice: parallel lists tokens / token_logprobs / top_logprobs /
    text_offset, where text_offset is each token's character offset in the choice's text (the echoed
    prompt included)."""

    def __init__(self, num_top: int, text: TokenText, as_ids: bool = False) -> None:
        self.num_top, self.text, self.as_ids = num_top, text, as_ids
        self.offset = 0  # characters of the tokens so far

    def prompt(self, prompt_token_ids: list[int], logprobs: Logprobs | None) -> dict[str, Any]:
        """Echoed prompt tokens: the first has no logprob (None), the others come from `logprobs`."""
        part = self._empty()
        self._add(part, prompt_token_ids[0], None, None)
        rows = zip(logprobs.token_ids, logprobs.logprobs, strict=True) if logprobs is not None else []
        for token_id, (ids, values) in zip(prompt_token_ids[1:], rows, strict=False):
            self._add(part, token_id, values[0], self._top(ids, values))
        return part

    def output(self, logprobs: Logprobs) -> dict[str, Any]:
        part = self._empty()
        for ids, values in zip(logprobs.token_ids, logprobs.logprobs, strict=True):
            self._add(part, ids[0], values[0], self._top(ids, values))
        return part

    def _top(self, ids: list[int], values: list[float]) -> dict[str, float]:
        pairs = zip(ids[1 : 1 + self.num_top], values[1 : 1 + self.num_top], strict=True)
        return {self.text(t, self.as_ids): _finite(v) for t, v in pairs}

    def _add(
        self, part: dict[str, Any], token_id: int, value: float | None, top: dict[str, float] | None
    ) -> None:
        token = self.text(token_id, self.as_ids)
        part["tokens"].append(token)
        part["token_logprobs"].append(None if value is None else _finite(value))
        part["top_logprobs"].append(top)
        part["text_offset"].append(self.offset)
        self.offset += len(token)

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def merge_completion_logprobs(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return part
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        total[key].extend(part[key])
    return total


def prompt_logprobs_body(logprobs: Logprobs | None, text: TokenText) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: one entry per prompt token, None for the first, else
    {token_id: {logprob, rank, decoded_token}} with the prompt's own token first."""
    if logprobs is None:
        return None
    entries: list[dict[str, Any] | None] = [None]
    for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks, strict=True):
        entry = {str(ids[0]): {"logprob": _finite(values[0]), "rank": rank, "decoded_token": text(ids[0])}}
        for position, (token_id, value) in enumerate(zip(ids[1:], values[1:], strict=True)):
            entry.setdefault(
                str(token_id),
                {"logprob": _finite(value), "rank": position + 1, "decoded_token": text(token_id)},
            )
        entries.append(entry)
    return entries


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return max(value, -9999.0)
