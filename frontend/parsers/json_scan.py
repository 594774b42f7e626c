"""Reading JSON as it streams in: where a value ends, and a call object's name and raw arguments text.

Everything here is prefix-stable: what it reports of a prefix of a text it also reports of the whole
text, so streamed deltas never need taking back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at `start`, or None if the text ends inside it."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        depth, i = 0, start
        while i < len(text):
            char = text[i]
            if char == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = start  # a number, true, false or null: ends at a delimiter
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


@dataclass
class PartialCall:
    """A tool call read so far: its name once complete, its arguments' raw text as far as it goes."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False  # the call object has closed
    end: int = 0  # index just past the object, when complete


def read_call_object(
    text: str, start: int, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
) -> PartialCall | None:
    """`{"name": "...", "arguments": {...}}` from text[start] on (keys in any order, the arguments' raw text
    kept as written); None if it is not such an object."""
    call = PartialCall()
    i = skip_whitespace(text, start)
    if i >= len(text):
        return call
    if text[i] != "{":
        return None
    i += 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return call
        if text[i] == "}":
            call.complete, call.end = True, i + 1
            return call
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        key_end = _string_end(text, i)
        if key_end is None:
            return call
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return call
        if text[i] != ":":
            return None
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return call
        end = value_end(text, i)
        if key in arguments_keys:
            call.arguments = text[i : end if end is not None else len(text)]
        elif key == "name" and end is not None:
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                return None
            call.name = name
        if end is None:
            return call
        i = end
