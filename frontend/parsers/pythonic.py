"""pythonic (Llama 3.2 and 4, ToolACE): the output is a Python list of calls,
`[get_weather(city="Paris"), get_time(tz="CET")]`, with literal keyword arguments. A call's name is
reported once `name(` is written, its arguments (as JSON) once its parenthesis closes: a call's
arguments are literals, which only make sense whole. In `auto` the whole output is constrained
(`auto_grammar`): a list of calls of known tools with their schemas' keyword arguments, or text that
does not begin with `[`."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from frontend.parsers.base import Parsed, ToolCall, ToolParser

CALL_START = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.\-]*)\(")


def _call_end(text: str, i: int) -> int | None:
    """Index past the `)` closing the call whose `(` is just before i, skipping strings and brackets."""
    depth, quote = 1, ""
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _arguments(source: str) -> str | None:
    """`f(a=1, b="x")` -> '{"a": 1, "b": "x"}', or None if it is not a call with literal keywords."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    try:
        values: dict[str, Any] = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        return None
    return json.dumps(values)


class PythonicToolParser(ToolParser):
    start_marker = "["

    def auto_grammar(self) -> str | None:
        rules = ["start: calls | TEXT", r"TEXT: /([^\[](.|\n)*)?/", 'calls: "[" call (", " call)* "]"']
        calls = []
        for index, tool in enumerate(self.tools):
            calls.append(f'{json.dumps(tool["function"]["name"] + "(")} t{index}_f0 ")"')
            rules += _keyword_rules(f"t{index}", tool["function"].get("parameters") or {})
        rules.append("call: " + " | ".join(calls))
        return "\n".join(rules)

    def parse(self, text: str, final: bool) -> Parsed:
        stripped = text.lstrip()
        if not stripped:
            return Parsed(content=text if final else "")
        if not stripped.startswith("["):
            return Parsed(content=text)
        calls: list[ToolCall] = []
        i = len(text) - len(stripped) + 1
        while True:
            match = CALL_START.match(text, i)
            if match is None:
                rest = text[i:].strip()
                if final and not calls:
                    return Parsed(content=text)  # a list, but not of calls
                if rest and not rest.startswith("]") and not rest.startswith(","):
                    return Parsed(calls=calls)
                if rest.startswith(","):
                    i = text.index(",", i) + 1
                    continue
                return Parsed(calls=calls)
            end = _call_end(text, match.end())
            if end is None:
                calls.append(ToolCall(match.group(1), ""))
                return Parsed(calls=calls)
            arguments = _arguments(text[match.start(1) : end])
            if arguments is None:
                return Parsed(content=text) if final and not calls else Parsed(calls=calls)
            calls.append(ToolCall(match.group(1), arguments))
            i = end


def _keyword_rules(prefix: str, schema: dict[str, Any]) -> list[str]:
    """`key=value` pairs in schema order, the required ones present, comma-separated: rule f{i} when no
    pair has been written yet, r{i} after one has."""
    properties = list((schema.get("properties") or {}).items())
    required = set(schema.get("required") or [])
    rules = [f'{prefix}_f{len(properties)}: ""', f'{prefix}_r{len(properties)}: ""']
    for i, (key, subschema) in enumerate(properties):
        pair = f"{json.dumps(key + '=')} {_literal(subschema if isinstance(subschema, dict) else {})}"
        first, rest = f"{prefix}_f{i}", f"{prefix}_r{i}"
        after = f"{prefix}_r{i + 1}"
        if key in required:
            rules += [f"{first}: {pair} {after}", f'{rest}: ", " {pair} {after}']
        else:
            rules += [
                f"{first}: {pair} {after} | {prefix}_f{i + 1}",
                f'{rest}: ", " {pair} {after} | {after}',
            ]
    return rules


def _literal(schema: dict[str, Any]) -> str:
    """A Python literal valid against the schema: JSON where the two agree, True/False/None where not."""
    if "enum" in schema:
        return "(" + " | ".join(json.dumps(_python_repr(choice)) for choice in schema["enum"]) + ")"
    kind = schema.get("type")
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return f"%json {json.dumps(schema or {'type': 'string'})}"


def _python_repr(value: Any) -> str:
    return repr(value) if isinstance(value, (bool, type(None))) else json.dumps(value)
