"""Tool calls the grammar forced (tool_choice "required" or a named function): the output is JSON, so
these read it directly, whatever the model's own tool-call format."""

from __future__ import annotations

from typing import Any

from frontend.parsers.base import Parsed, ToolCall, ToolParser
from frontend.parsers.json_scan import read_call_object, skip_whitespace, value_end


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments."""

    def __init__(self, tools: list[dict[str, Any]], name: str) -> None:
        super().__init__(tools)
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_whitespace(text, 0)
        end = value_end(text, start) if start < len(text) else None
        return Parsed(calls=[ToolCall(self.name, text[start : end if end is not None else len(text)])])

    def schema(self) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == self.name)
        return dict(tool["function"].get("parameters") or {"type": "object"})


class RequiredToolParser(ToolParser):
    """`[{"name": ..., "parameters": {...}}, ...]`: one call or more (one at most without parallel calls)."""

    def __init__(self, tools: list[dict[str, Any]], parallel: bool = True) -> None:
        super().__init__(tools)
        self.parallel = parallel

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        i = skip_whitespace(text, 0)
        if i >= len(text) or text[i] != "[":
            return parsed
        i += 1
        while True:
            i = skip_whitespace(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            if i >= len(text) or text[i] == "]":
                return parsed
            call = read_call_object(text, i)
            if call is None:
                return parsed
            if call.name is not None:
                parsed.calls.append(ToolCall(call.name, call.arguments or ("{}" if call.complete else "")))
            if not call.complete:
                return parsed
            i = call.end

    def schema(self) -> dict[str, Any]:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": tool["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema
