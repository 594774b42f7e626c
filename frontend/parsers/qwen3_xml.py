"""qwen3_xml (Qwen3-Coder): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
</function>\n</tool_call>`. Values are text, typed by the tool's schema (a number, boolean, array or
object is read as JSON; anything else stays a string). The arguments' JSON grows one whole parameter
at a time and closes with `</function>`. In `auto`, each call is constrained from `<tool_call>` on by a Lark grammar made from the
tool's schema (`parameters_grammar`): its parameters in schema order, the required ones present, plain
strings as free text, enums and patterns as such, every other value as JSON valid against its schema."""

from __future__ import annotations

import json
import re
from typing import Any

from frontend.parsers.base import Parsed, ToolCall, ToolParser, text_until

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3XmlToolParser(ToolParser):
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _types(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict((tool["function"].get("parameters") or {}).get("properties") or {})
        return {}

    def _value(self, name: str, key: str, text: str) -> str:
        kind = self._types(name).get(key, {}).get("type", "string")
        if kind != "string":
            try:
                return json.dumps(json.loads(text))
            except json.JSONDecodeError:
                pass
        return json.dumps(text)

    def structural_tag(self) -> dict[str, Any] | None:
        structures = [
            {
                "begin": f"<tool_call>\n<function={tool['function']['name']}>\n",
                "grammar": parameters_grammar(tool["function"].get("parameters") or {}),
                "end": "</function>\n</tool_call>",
            }
            for tool in self.tools
        ]
        return {"type": "structural_tag", "structures": structures, "triggers": [self.start_marker]}

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        i = 0
        while True:
            content, start = text_until(text, i, self.start_marker, final)
            parsed.content += content
            if start is None:
                return parsed
            function = FUNCTION.match(text, start + len(self.start_marker))
            if function is None:
                parsed.content += text[start:] if final else ""
                return parsed
            name = function.group(1).strip()
            j, pieces = function.end(), []
            while (parameter := PARAMETER.match(text, j)) is not None:
                key = parameter.group(1).strip()
                pieces.append(f"{json.dumps(key)}: {self._value(name, key, parameter.group(2))}")
                j = parameter.end()
            closed = re.match(r"\s*</function>", text[j:])
            arguments = "{" + ", ".join(pieces) + ("}" if closed else "")
            parsed.calls.append(ToolCall(name, arguments))
            if not closed:
                return parsed
            close = text.find(self.end_marker, j)
            if close < 0:
                return parsed
            i = close + len(self.end_marker)


def parameters_grammar(schema: dict[str, Any]) -> str:
    """A Lark grammar for a call's `<parameter=...>` blocks under a JSON schema of an object."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    rules, sequence = [], []
    close = json.dumps("\n</parameter>\n")
    for index, (key, subschema) in enumerate(properties.items()):
        name = f"p{index}"
        sequence.append(name if key in required else f"{name}?")
        rules.append(f"{name}: {json.dumps(f'<parameter={key}>' + chr(10))} v{index}")
        rules.append(_value_rule(f"v{index}", subschema if isinstance(subschema, dict) else {}, close))
    if not sequence:
        return 'start: ""'
    return "\n".join([f"start: {' '.join(sequence)}", *rules])


def _value_rule(name: str, schema: dict[str, Any], close: str) -> str:
    """A parameter's value as it is written between the tags (plain text for strings)."""
    if schema.get("type") == "string" and "enum" in schema:
        return f"{name}: ({' | '.join(json.dumps(str(choice)) for choice in schema['enum'])}) {close}"
    if schema.get("type") == "string" and "pattern" in schema:
        pattern = schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/")
        return f"{name}: /{pattern}/ {close}"
    if schema.get("type", "string") == "string" and not {"enum", "const", "anyOf", "oneOf"} & set(schema):
        return f"{name}[lazy]: /(.|\\n)*/ {close}"
    return f"{name}: %json {json.dumps(schema)} {close}"
