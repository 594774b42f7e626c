"""The Responses API's shapes: output items (reasoning, message, function_call), usage, and the streamed
events that build the items piece by piece.

Streamed or not, a response's items are the ones its events built (responses/tool_loop.py), from the
pieces the output path reads (`frontend/engine/pieces.py`, where whitespace between items waits until
it is text)."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def call_id(parser_id: str | None) -> str:
    return f"call_{(parser_id or uuid.uuid4().hex).rpartition('-')[2][:24]}"


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": content, "status": status}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status, "content": content}


def call_item(
    parser_id: str | None, name: str | None, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id(parser_id),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def status_of(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) of a finished choice."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


class EventStream:
    """The events of one streamed response, numbered, and the items they built."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # the open item's text (or arguments) so far

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"

    @property
    def output_index(self) -> int:
        return len(self.items)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": self.output_index}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[bytes]:
        events = self.close()
        self.open, self.text = item, ""
        events.append(self.event("response.output_item.added", output_index=self.output_index, item=item))
        if part is not None:
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        return events

    def close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        events, where, text = [], self._where(), self.text
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = {**item, "content": [part]}
        elif item["type"] == "message":
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=_text_part(text))
            )
            item = {**item, "content": [_text_part(text)]}
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=text
                )
            )
            item = {**item, "arguments": text}
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=self.output_index, item=item))
        self.items.append(item)
        self.open = None
        return events

    def reasoning(self, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events = self._start(reasoning_item("", "in_progress"), {"type": "reasoning_text", "text": ""})
        self.text += text
        return [
            *events,
            self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text),
        ]

    def content(self, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events = self._start(message_item("", "in_progress"), _text_part(""))
        self.text += text
        delta = self.event(
            "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]
        )
        return [*events, delta]

    def call(self, parser_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        events: list[bytes] = []
        if parser_id is not None:
            events = self._start(call_item(parser_id, name, "", "in_progress"), None)
        if arguments:
            self.text += arguments
            events.append(
                self.event("response.function_call_arguments.delta", **self._where(), delta=arguments)
            )
        return events
