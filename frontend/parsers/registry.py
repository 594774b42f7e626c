"""Parsers by name (vLLM's --tool-call-parser and --reasoning-parser), plus a plugin file's.

A plugin (--tool-parser-plugin PATH) is a Python file that defines TOOL_PARSERS = {"name": ToolParser
subclass}; it is loaded once per server, into that server's Parsers, never into a global registry.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from frontend.parsers.base import ReasoningParser, ToolParser
from frontend.parsers.hermes import HermesToolParser
from frontend.parsers.json_formats import Llama3JsonToolParser, MistralToolParser
from frontend.parsers.pythonic import PythonicToolParser
from frontend.parsers.qwen3_xml import Qwen3XmlToolParser
from frontend.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

BUILTIN_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
}
BUILTIN_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


@dataclass(frozen=True)
class Parsers:
    tool_parsers: dict[str, type[ToolParser]] = field(default_factory=lambda: dict(BUILTIN_TOOL_PARSERS))
    reasoning_parsers: dict[str, type[ReasoningParser]] = field(
        default_factory=lambda: dict(BUILTIN_REASONING_PARSERS)
    )

    @classmethod
    def with_plugin(cls, path: str | None) -> Parsers:
        parsers = cls()
        if path:
            parsers.tool_parsers.update(load_plugin(path))
        return parsers

    def tool_parser(self, name: str) -> type[ToolParser]:
        if name not in self.tool_parsers:
            raise ValueError(
                f"unknown tool call parser {name!r}; choose one of {', '.join(self.tool_parsers)}"
            )
        return self.tool_parsers[name]

    def reasoning_parser(self, name: str) -> type[ReasoningParser]:
        if name not in self.reasoning_parsers:
            known = ", ".join(self.reasoning_parsers)
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {known}")
        return self.reasoning_parsers[name]


def load_plugin(path: str) -> dict[str, type[ToolParser]]:
    """The TOOL_PARSERS of the plugin file at `path`; ValueError for a file that is missing, fails to
    import or lacks them."""
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location("engine_tool_parser_plugin", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load the tool parser plugin {path!r}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the plugin's own code: whatever it raises, it did not load
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"cannot import {path}: {type(error).__name__}: {first_line}") from error
    found: Any = getattr(module, "TOOL_PARSERS", None)
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and isinstance(v, type) and issubclass(v, ToolParser) for k, v in found.items()
    ):
        raise ValueError(f"{path} must define TOOL_PARSERS = {{name: ToolParser subclass}}")
    return dict(found)
