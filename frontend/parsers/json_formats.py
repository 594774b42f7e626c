"""Tool-call formats made of JSON objects.

- llama3_json (Llama 3.1/3.2): the output is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several separated by `;`; anything else is content.
- mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`.
"""

from __future__ import annotations

from typing import Any

from frontend.parsers.base import Parsed, ToolCall, ToolParser, call_structures, held_back
from frontend.parsers.json_scan import read_call_object, skip_whitespace


def read_calls(text: str, i: int, separators: str, closing: str = "") -> tuple[list[ToolCall], int, bool]:
    """Call objects from text[i] on, between separators, until `closing` (or the end): (calls, index
    after them, whether the text went on past them into something that is not a call)."""
    calls: list[ToolCall] = []
    while True:
        i = skip_whitespace(text, i)
        while i < len(text) and text[i] in separators:
            i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return calls, i, False
        if closing and text[i] == closing:
            return calls, i + 1, False
        call = read_call_object(text, i)
        if call is None:
            return calls, i, True
        if call.name is None:
            return calls, i, False
        calls.append(ToolCall(call.name, call.arguments or ("{}" if call.complete else "")))
        if not call.complete:
            return calls, len(text), False
        i = call.end


class Llama3JsonToolParser(ToolParser):
    start_marker = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_whitespace(text, 0)
        if text.startswith(self.start_marker, start):
            start += len(self.start_marker)
        elif not final and held_back(text[start:], self.start_marker) == len(text) - start:
            return Parsed()  # could still be the python tag
        start = skip_whitespace(text, start)
        if start >= len(text):
            return Parsed(content=text if final else "")
        if text[start] != "{":
            return Parsed(content=text)
        calls, _, stray = read_calls(text, start, ";")
        if not calls and (final or stray):
            return Parsed(content=text)
        return Parsed(calls=calls)

    def structural_tag(self) -> dict[str, Any] | None:
        return call_structures(self.tools, lambda name: f'{{"name": {name}, "parameters": ', "}", '{"name": ')


class MistralToolParser(ToolParser):
    start_marker = "[TOOL_CALLS]"
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token in Mistral's tokenizers

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.start_marker)
        if start < 0:
            return Parsed(content=text if final else text[: len(text) - held_back(text, self.start_marker)])
        i = skip_whitespace(text, start + len(self.start_marker))
        if i < len(text) and text[i] == "[":
            i += 1
        calls, _, _ = read_calls(text, i, ",", closing="]")
        return Parsed(content=text[:start], calls=calls)

    def structural_tag(self) -> dict[str, Any] | None:
        begin = lambda name: f'[TOOL_CALLS][{{"name": {name}, "arguments": '  # noqa: E731
        return call_structures(self.tools, begin, "}]", self.start_marker)
