"""The contract of a text parser, and the one streaming rule every parser shares.

A parser reads a choice's whole text so far: `parse(text, final)` returns what it holds (reasoning,
content, tool calls). For a prefix (final False) it reports only what no later text can change: it
holds back a possible start of a marker, and a call's arguments grow but never change. So streaming is
the same parse on each longer prefix, and `StreamingParse` sends the difference; the concatenated
deltas equal the non-streamed result by construction.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # a partial call has name set and partial arguments


class ToolParser(ABC):
    """Tool calls in a model's text. Subclasses name their format; `start_marker` is where a call begins
    (the structural tag's trigger), `structural_tag` constrains each call once that marker appears."""

    start_marker: str = ""
    keeps_special_tokens = False  # the marker is a special token: the text must keep special tokens

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """Content and calls of `text` (reasoning already removed); see the module docstring."""

    def structural_tag(self) -> dict[str, Any] | None:
        """vLLM's structural tag for `auto`: each tool's call, constrained from the start marker on."""
        return None

    def auto_grammar(self) -> str | None:
        """A whole-output Lark grammar for `auto`, for formats a structural tag cannot express."""
        return None


class ReasoningParser(ABC):
    """A reasoning section (between think markers) and the answer after it."""

    start_marker = "<think>"
    end_marker = "</think>"

    def __init__(self, thinking: bool = True, opened_in_prompt: bool = False) -> None:
        self.thinking = thinking  # chat_template_kwargs enable_thinking
        self.opened_in_prompt = opened_in_prompt  # the prompt ends with the start marker (the template
        # opened the section, as Qwen3-Thinking's and DeepSeek-R1's do)

    @property
    def starts_in_reasoning(self) -> bool:
        """The output begins inside the reasoning section: an output constraint waits for its end."""
        return self.thinking and self.opened_in_prompt

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """reasoning and content of `text` (calls unset)."""


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`: not yet safe to show."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def text_until(text: str, i: int, marker: str, final: bool) -> tuple[str, int | None]:
    """The content from i to the next `marker` and where the marker starts; with no marker, all the rest
    (less a possible start of the marker, unless final) and None."""
    start = text.find(marker, i)
    if start >= 0:
        return text[i:start], start
    tail = text[i:]
    return (tail if final else tail[: len(tail) - held_back(tail, marker)]), None


def call_structures(tools: list[dict[str, Any]], begin: Any, end: str, trigger: str) -> dict[str, Any]:
    """vLLM's structural tag: for each tool, `begin(name)`, then its parameters' schema, then `end`."""
    structures = [
        {
            "begin": begin(json.dumps(tool["function"]["name"])),
            "schema": tool["function"].get("parameters") or {"type": "object"},
            "end": end,
        }
        for tool in tools
    ]
    return {"type": "structural_tag", "structures": structures, "triggers": [trigger]}


@dataclass
class CallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class StreamingParse:
    """Feeds a growing text through a parse function and returns what is new each time."""

    def __init__(self, parse: Any) -> None:
        self.parse = parse  # (text, final) -> Parsed
        self.sent = Parsed()
        self.sent_arguments: list[int] = []  # characters of each call's arguments already sent

    def update(self, text: str, final: bool) -> Delta:
        now: Parsed = self.parse(text, final)
        delta = Delta(
            content=now.content[len(self.sent.content) :]
            if now.content.startswith(self.sent.content)
            else "",
            reasoning=now.reasoning[len(self.sent.reasoning) :],
        )
        for index, call in enumerate(now.calls):
            if index >= len(self.sent.calls):
                self.sent.calls.append(call)
                self.sent_arguments.append(0)
                delta.calls.append(CallDelta(index, call.id, call.name, call.arguments))
            else:
                call.id = self.sent.calls[index].id  # the id the client already has
                self.sent.calls[index] = call
                delta.calls.append(CallDelta(index, arguments=call.arguments[self.sent_arguments[index] :]))
            self.sent_arguments[index] = len(call.arguments)
        delta.calls = [d for d in delta.calls if d.id or d.arguments]
        self.sent.content, self.sent.reasoning = now.content, now.reasoning
        return delta

    @property
    def result(self) -> Parsed:
        return self.sent
