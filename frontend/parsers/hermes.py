"""hermes (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

from typing import Any

from frontend.parsers.base import Parsed, ToolCall, ToolParser, call_structures, text_until
from frontend.parsers.json_scan import read_call_object


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        i = 0
        while True:
            content, start = text_until(text, i, self.start_marker, final)
            parsed.content += content
            if start is None:
                return parsed
            body = start + len(self.start_marker)
            call = read_call_object(text, body)
            if call is None or call.name is None:  # not a call (yet): text, once nothing more can come
                parsed.content += text[start:] if final else ""
                return parsed
            # NOTE: a call cut short (max_tokens) stays a call: its name and arguments were streamed already
            parsed.calls.append(ToolCall(call.name, call.arguments or ("{}" if call.complete else "")))
            if not call.complete:
                return parsed
            close = text.find(self.end_marker, call.end)
            if close < 0 or text[call.end : close].strip():
                return parsed  # the closing tag is still to come (or was cut off): the call is whole
            i = close + len(self.end_marker)

    def structural_tag(self) -> dict[str, Any] | None:
        begin = lambda name: f'<tool_call>\n{{"name": {name}, "arguments": '  # noqa: E731
        return call_structures(self.tools, begin, "}\n</tool_call>", self.start_marker)
