"""OpenAI Responses request bodies (POST /v1/responses) and their one translation into the chat form
every door renders through (`to_chat_request`).

Input items become chat messages: messages (input_text / output_text parts), function_call items as
the assistant's tool calls, function_call_output items as tool messages, reasoning items as the next
assistant turn's reasoning. `instructions` is the system message (not carried over by
previous_response_id, as OpenAI does). As on every door, no field is accepted and ignored.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from frontend.openai.schemas import (
    ChatCompletionRequest,
    chat_request,
    check_fields,
    check_one_of,
    unsupported,
)
from frontend.server.errors import OpenAIError

from .mcp_client import error_message as error_text
from .mcp_tools import declined_text

logger = logging.getLogger("engine.api")

UNSUPPORTED_FIELDS = {
    "background": "background responses",
    "conversation": "conversations (use previous_response_id)",
    "prompt": "prompt templates",
    "context_management": "context management",
    "prompt_cache_retention": "prompt-cache retention",
    "prompt_cache_options": "prompt-cache options",
    "moderation": "moderation",
    "image": "image generation",
    "access_programs": "access programs",
    "background_options": "background responses",
    "stream_options": "stream options",
    "top_logprobs": "logprobs on this door",
}
METADATA_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None  # the MCP tool calls one response runs at most (tool_loop.py)
    ignore_eos: bool = False  # vLLM's sampling extension, as on the chat door (benchmarks send it)

    def check_supported(self) -> None:
        # false and 0 ask for nothing here too (background: false, top_logprobs: 0)
        check_fields(self, UNSUPPORTED_FIELDS, asks_nothing=(None, False, 0))
        check_one_of("service_tier", self.service_tier, (None, "auto", "default"))
        check_one_of("truncation", self.truncation, (None, "disabled"))  # the context limit is a 400
        if self.include:
            raise unsupported("include", f"include {self.include!r}")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise OpenAIError("max_tool_calls must be 1 or more.", param="max_tool_calls")


def to_chat_request(
    body: ResponsesRequest,
    items: list[dict[str, Any]],
    mcp_functions: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    max_tokens: int | None = None,
) -> ChatCompletionRequest:
    """items: the conversation so far (a continued response's items, this input, this response's output
    items of earlier tool-loop turns); mcp_functions: the MCP servers' tools as function tools;
    tool_choice and max_tokens: this turn's, where the tool loop sets them (responses/tool_loop.py)."""
    body.check_supported()
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += input_messages(items)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens if max_tokens is None else max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        "ignore_eos": body.ignore_eos,
        **{name: getattr(body, name) for name in METADATA_FIELDS},
    }
    if body.tools is not None:
        tools = [_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools) if not _is_mcp(tool)]
        fields["tools"] = tools + (mcp_functions or [])
    if (choice := tool_choice if tool_choice is not None else body.tool_choice) is not None:
        fields["tool_choice"] = _tool_choice(choice)
    if body.text is not None:
        fields["response_format"] = _text_format(body.text)
    if body.reasoning is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": _thinking(body.reasoning)}
    return chat_request(fields)


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    asked: dict[str, dict[str, Any]] = {}  # mcp_approval_request items, by id
    for index, item in enumerate(items):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{param} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise OpenAIError(
                    f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}; got {role!r}.", param="input"
                )
            message: dict[str, Any] = {"role": role, "content": _content(item.get("content"), param)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise OpenAIError(
                    f"{param}: a function_call needs a name and arguments (a JSON string).", param="input"
                )
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last and last["content"]:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise OpenAIError(f"{param}: a function_call_output needs its call_id.", param="input")
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), param)}
            )
        elif kind == "mcp_call":  # the call and its result, as the model read them in the tool loop
            result = (
                item.get("output") if item.get("error") is None else f"Error: {error_text(item['error'])}"
            )
            messages += _call_messages(item, str(result or ""), param)
        elif kind == "mcp_approval_request":  # asked; an approval runs it (an mcp_call item follows)
            asked[str(item.get("id"))] = item
        elif kind == "mcp_approval_response":
            request = asked.get(str(item.get("approval_request_id")))
            if request is not None and item.get("approve") is False:  # the model learns it was declined
                messages += _call_messages(request, declined_text(request), param)
        elif kind == "mcp_list_tools":
            pass  # the tools are in the prompt's tool list
        elif kind == "reasoning":
            parts = item.get("content") or []
            reasoning += "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        else:
            raise unsupported(f"{param}.type", f"{kind!r} input items")
    return messages


def _call_messages(item: dict[str, Any], result: str, param: str) -> list[dict[str, Any]]:
    """An MCP call as the assistant's tool call and the tool's message."""
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
        raise OpenAIError(
            f"{param}: an {item.get('type')} needs a name and arguments (a JSON string).", param="input"
        )
    call_id, arguments = str(item.get("id")), item["arguments"]
    try:
        json.loads(arguments)
    except ValueError:  # a call the output's end cut short (never run): the model reads it as empty
        arguments = "{}"
    call = {"id": call_id, "type": "function", "function": {"name": item["name"], "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def _content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or, where it holds input_image parts, chat content parts (text and
    image_url, in order) for the chat door's image path (frontend/vision/)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text(content, param)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            parts.append(_image_part(part, f"{param}.content[{index}]"))
        else:
            raise unsupported(f"{param}.content", f"{kind!r} content parts (text and input_image)")
    return parts


def _image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """input_image {image_url: URL string, detail} -> a chat image_url part (detail may be left out: vLLM's
    pending fix defaults it to auto; file_id needs a files API this server does not have)."""
    if part.get("file_id") is not None:
        raise unsupported(f"{param}.file_id", "input_image file_id (send image_url)")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise OpenAIError(f"{param}.image_url must be a URL string.", param="input")
    image: dict[str, Any] = {"url": url, "detail": part.get("detail") or "auto"}
    return {"type": "image_url", "image_url": image, **({"uuid": part["uuid"]} if "uuid" in part else {})}


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{param}.content must be a string or a list of parts.", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS:
            raise unsupported(f"{param}.content", f"{kind!r} content parts (text only)")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _is_mcp(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") == "mcp"


def _tool(tool: Any, param: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if kind != "function":
        raise unsupported(param, f"{kind!r} tools (function tools only)")
    function = {
        key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None
    }
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: checked on the chat path
    if choice.get("type") not in ("function", "mcp") or not isinstance(choice.get("name"), str):
        raise unsupported("tool_choice", f"tool_choice {choice!r} (a function or an MCP tool by name only)")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(text: dict[str, Any]) -> dict[str, Any] | None:
    if text.get("verbosity") is not None:
        raise unsupported("text.verbosity", "verbosity")
    form = text.get("format")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise OpenAIError(
            'text.format is text, json_object or {"type": "json_schema", "schema": ...}.', param="text.format"
        )
    schema = {
        key: form[key] for key in ("name", "schema", "strict", "description") if form.get(key) is not None
    }
    return {"type": "json_schema", "json_schema": {"name": "output", **schema}}


def _thinking(reasoning: dict[str, Any]) -> bool:
    """reasoning.effort "none" closes the thinking (the template's enable_thinking); other levels and
    summaries are not ours."""
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise unsupported("reasoning.summary", "reasoning summaries")
    effort = reasoning.get("effort")
    if effort not in (None, "none"):
        raise unsupported("reasoning.effort", f"effort {effort!r} (only none, or leave it unset)")
    return effort is None
