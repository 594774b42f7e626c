"""Tool calling and reasoning for one chat request: which tools, which choice, the grammar that enforces
it, and the parser that reads each choice's text.

- tool_choice "required" and a named function are grammar-constrained (frontend/parsers/forced.py), so
  the output is always a valid call; "auto" is constrained from the parser's start marker on (its
  structural tag), so a call the model starts is always valid too; "none" leaves the text alone.
- The legacy `functions` / `function_call` fields map onto `tools` / `tool_choice`.
- With a reasoning parser, the constraint applies after the reasoning section ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.openai.schemas import ChatCompletionRequest
from frontend.openai.serving import OpenAIServing
from frontend.parsers.base import Parsed, ReasoningParser, ToolParser
from frontend.parsers.forced import NamedToolParser, RequiredToolParser
from frontend.server.errors import OpenAIError
from protocol.structured_outputs import StructuredOutputsParams

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ChatPlan:
    """How one chat request's choices are constrained and read."""

    tools: list[dict[str, Any]] | None
    tool_choice: str  # "none", "auto", "required" or "named"
    spec: StructuredOutputsParams | None  # the output constraint (the caller's, or the tools')
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None
    parallel_tool_calls: bool = True  # False: one call at most (auto's tag lets the model write more)

    @property
    def parses(self) -> bool:
        return self.tool_parser is not None or self.reasoning_parser is not None

    def parse(self, text: str, final: bool) -> Parsed:
        """Reasoning, then tool calls in what follows it."""
        parsed = Parsed(content=text)
        if self.reasoning_parser is not None:
            parsed = self.reasoning_parser.parse(text, final)
        if self.tool_parser is not None:
            calls = self.tool_parser.parse(parsed.content, final)
            parsed.content, parsed.calls = calls.content, calls.calls
            if not self.parallel_tool_calls:
                parsed.calls = parsed.calls[:1]  # prefix-stable: the first call never changes
        return parsed

    def finish_reason(self, parsed: Parsed, reason: str | None) -> str | None:
        if reason == "stop" and parsed.calls and self.tool_choice in ("auto", "required"):
            return "tool_calls"
        return reason


@dataclass
class ToolSelection:
    tools: list[dict[str, Any]] | None  # the request's tools (or its legacy functions, mapped)
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function a named choice forces


def plan_chat(
    body: ChatCompletionRequest,
    serving: OpenAIServing,
    selection: ToolSelection,
    spec: StructuredOutputsParams | None,
    prompt_text: str,
) -> ChatPlan:
    """spec: the caller's own constraint (response_format, ...); prompt_text: the rendered prompt."""
    tools, choice, named = selection.tools, selection.choice, selection.named
    for index, tool in enumerate(tools or []):
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            serving.validator.validate(
                StructuredOutputsParams(json=parameters), f"tools[{index}].function.parameters"
            )
    tool_parser: ToolParser | None = None
    tool_spec: StructuredOutputsParams | None = None
    if choice == "named":
        assert tools is not None and named is not None
        forced = NamedToolParser(tools, named)
        tool_parser, tool_spec = forced, StructuredOutputsParams(json=forced.schema())
    elif choice == "required":
        assert tools is not None
        required = RequiredToolParser(tools, body.parallel_tool_calls is not False)
        tool_parser, tool_spec = required, StructuredOutputsParams(json=required.schema())
    elif choice == "auto":
        assert tools is not None and serving.tool_call_parser is not None
        tool_parser = serving.parsers.tool_parser(serving.tool_call_parser)(tools)
        tag, grammar = tool_parser.structural_tag(), tool_parser.auto_grammar()
        if spec is None:  # NOTE: the caller's own constraint wins over the tools'
            if tag is not None:
                tool_spec = StructuredOutputsParams(structural_tag=json.dumps(tag))
            elif grammar is not None:
                tool_spec = StructuredOutputsParams(grammar=grammar)
    if tool_spec is not None and spec is not None and choice != "auto":
        raise OpenAIError(
            f"tool_choice {'a named function' if choice == 'named' else repr(choice)} constrains the output "
            "itself; drop response_format "
            "(or structured_outputs).",
            param="response_format",
        )
    if tool_spec is not None:
        serving.validator.validate(tool_spec, "tools")
        spec = tool_spec
    reasoning_parser = _reasoning_parser(body, serving, prompt_text)
    # NOTE: a constraint waits for the reasoning to end only where the output is known to start in it
    # (deepseek_r1, or a template that opened <think>); otherwise it applies from the first token.
    if spec is not None and reasoning_parser is not None and reasoning_parser.starts_in_reasoning:
        end = serving.require_tokenizer("messages")(reasoning_parser.end_marker, add_special_tokens=False)
        spec = msgspec.structs.replace(spec, start_after_token_ids=list(end["input_ids"]))
    parallel = body.parallel_tool_calls is not False
    return ChatPlan(tools, choice, spec, tool_parser, reasoning_parser, parallel)


def _reasoning_parser(
    body: ChatCompletionRequest, serving: OpenAIServing, prompt_text: str
) -> ReasoningParser | None:
    if serving.reasoning_parser is None:
        return None
    cls = serving.parsers.reasoning_parser(serving.reasoning_parser)
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    opened = prompt_text.rstrip().endswith(cls.start_marker)
    return cls(thinking=thinking, opened_in_prompt=opened)


def select_tools(body: ChatCompletionRequest, serving: OpenAIServing) -> ToolSelection:
    """The tools and the choice among them, checked: 400 for bad tools or a choice that cannot be."""
    selection = _select(body)
    if selection.choice == "auto" and not (serving.enable_auto_tool_choice and serving.tool_call_parser):
        raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")
    return selection


def _select(body: ChatCompletionRequest) -> ToolSelection:
    tools, tool_choice = body.tools, body.tool_choice
    if body.functions is not None:
        if tools is not None:
            raise OpenAIError("give tools or functions, not both.", param="functions")
        tools = [{"type": "function", "function": function} for function in body.functions]
    if body.function_call is not None:
        if tool_choice is not None:
            raise OpenAIError("give tool_choice or function_call, not both.", param="function_call")
        call = body.function_call
        tool_choice = {"type": "function", "function": call} if isinstance(call, dict) else call
    _check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}.', param="tool_choice"
            )
        if not tools or name not in {tool["function"]["name"] for tool in tools}:
            raise OpenAIError(
                f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice"
            )
        return ToolSelection(tools, "named", name)
    if tool_choice not in ("none", "auto", "required"):
        raise OpenAIError(
            f"tool_choice must be none, auto, required or a named function; got {tool_choice!r}.",
            param="tool_choice",
        )
    if tool_choice != "none" and not tools:
        raise OpenAIError(f'tool_choice "{tool_choice}" needs tools.', param="tool_choice")
    return ToolSelection(tools, tool_choice)


def _check_tools(tools: list[dict[str, Any]] | None) -> None:
    names: set[str] = set()
    for index, tool in enumerate(tools or []):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise OpenAIError('each tool must be {"type": "function", "function": {...}}.', param=param)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise OpenAIError("a tool needs a function object.", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise OpenAIError(
                "a function name is 1 to 64 letters, digits, underscores, dots or dashes.",
                param=f"{param}.function.name",
            )
        if name in names:
            raise OpenAIError(f"two tools are named {name!r}.", param=f"{param}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise OpenAIError("function parameters must be a JSON schema object.", param=f"{param}.function")
        if function.get("strict") not in (None, True, False):
            raise OpenAIError("function strict must be a boolean.", param=f"{param}.function")
