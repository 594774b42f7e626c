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

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"<{token_id}>"
            self._cache[token_id] = text
        return text


def chat_logprobs(logprobs: Logprobs, num_top: int, text: TokenText) -> list[dict[str, Any]]:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]} entries."""
    entries = []
    for ids, values in zip(logprobs.token_ids, logprobs.logprobs, strict=True):
        token = text(ids[0])
        entries.append(
            {
                "token": token,
                "logprob": _finite(values[0]),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": text(t), "logprob": _finite(v), "bytes": list(text(t).encode())}
                    for t, v in zip(ids[1 : 1 + num_top], values[1 : 1 + num_top], strict=True)
                ],
            }
        )
    return entries


def completion_logprobs(
    logprobs: Logprobs, num_top: int, text: TokenText, text_offset: int
) -> dict[str, Any]:
    """Completions shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    result: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ids, values in zip(logprobs.token_ids, logprobs.logprobs, strict=True):
        token = text(ids[0])
        result["tokens"].append(token)
        result["token_logprobs"].append(_finite(values[0]))
        result["top_logprobs"].append(
            {text(t): _finite(v) for t, v in zip(ids[1 : 1 + num_top], values[1 : 1 + num_top], strict=True)}
        )
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result


def merge_completion_logprobs(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return part
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        total[key].extend(part[key])
    return total


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return max(value, -9999.0)
