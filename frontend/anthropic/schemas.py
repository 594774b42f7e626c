"""Anthropic Messages request bodies (POST /v1/messages, /v1/messages/count_tokens), and their one
translation into the chat form every door renders through (`to_chat_request`).

As on the OpenAI doors, no field is accepted and ignored: a field Anthropic defines that we do not
implement is a 400 naming it (`UNSUPPORTED_FIELDS`); `cache_control` hints and `metadata` change no
output (our prefix cache is automatic) and pass.
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

logger = logging.getLogger("engine.api")

UNSUPPORTED_FIELDS = {
    "container": "code-execution containers",
    "mcp_servers": "MCP servers",
    "context_management": "context management",
    "output_format": "the beta output_format (use output_config.format)",
    "inference_geo": "inference regions",
    "diagnostics": "prompt-cache diagnostics",
}
# Fields that change no output: accepted (a prompt-cache hint; our prefix cache is automatic; ids)
PASSING_FIELDS = ("cache_control", "user_profile_id", "workspace_id")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {"type": "tool", "name"}


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    output_config: dict[str, Any] | None = None  # format (json_schema); effort is not ours

    def check_supported(self) -> None:
        check_fields(self, UNSUPPORTED_FIELDS, passing=PASSING_FIELDS)


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    service_tier: str | None = None
    speed: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        check_one_of("service_tier", self.service_tier, (None, "auto", "standard_only"))
        check_one_of("speed", self.speed, (None, "standard"))


def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The same request as a chat completion: system first, tool results as tool messages, tool_use
    blocks as the assistant's tool calls, thinking as its reasoning."""
    body.check_supported()
    messages = _system_messages(body.system)
    for index, message in enumerate(body.messages):
        messages.extend(_chat_messages(message, f"messages[{index}]"))
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools is not None:
        fields["tools"] = [_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields.update(_tool_choice(body.tool_choice))
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": _thinking(body.thinking)}
    if body.output_config is not None:
        fields["response_format"] = _output_format(body.output_config)
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            metadata=body.metadata,
            stream=body.stream,
        )
    return chat_request(fields)


def _system_messages(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(_texts(system, "system", ("text",)))
    return [{"role": "system", "content": text}]


def _chat_messages(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise OpenAIError(f"{param}.role must be user or assistant; got {role!r}.", param=param)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{param}.content must be a string or a list of blocks.", param=param)
    if role == "assistant":
        return [_assistant(content, param)]
    results = [_tool_result(block, param) for block in content if _kind(block, param) == "tool_result"]
    rest = [b for b in content if b.get("type") != "tool_result"]
    if any(
        b.get("type") == "image" for b in rest
    ):  # chat content parts, for the image path (frontend/vision/)
        parts = [_image(b, param) if b.get("type") == "image" else {"type": "text", "text": _texts([b], param, ("text",))[0]}
                 for b in rest]  # fmt: skip
        return [*results, {"role": "user", "content": parts}]
    texts = _texts(rest, param, ("text",))
    return [*results, *([{"role": "user", "content": "".join(texts)}] if texts else [])]


def _image(block: dict[str, Any], param: str) -> dict[str, Any]:
    """An image block -> a chat image_url part: a url source as it is, a base64 one as a data URL (vLLM's
    mapping; its media_type defaults to image/jpeg)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise OpenAIError(f"{param}: an image block needs a source object.", param=param)
    kind = source.get("type")
    if kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    elif kind == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/jpeg'};base64,{source['data']}"
    else:
        raise OpenAIError(f"{param}: an image source is {{type: base64, media_type, data}} or {{type: url, url}}.",
                          param=param)  # fmt: skip
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(content: list[Any], param: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for block in content:
        kind = _kind(block, param)
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            if not isinstance(block.get("input", {}), dict) or not isinstance(block.get("name"), str):
                raise OpenAIError(f"{param}: a tool_use block needs a name and an input object.", param=param)
            arguments = json.dumps(block.get("input", {}))
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        else:
            raise OpenAIError(f"{param}: {kind} blocks are not supported in an assistant turn.", param=param)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)  # the name chat templates read
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    content = block.get("content", "")
    text = content if isinstance(content, str) else "".join(_texts(content, param, ("text",)))
    if block.get("is_error"):
        text = f"Error: {text}"  # NOTE: the template has no error flag; the text says it
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def _texts(blocks: Any, param: str, kinds: tuple[str, ...]) -> list[str]:
    if not isinstance(blocks, list):
        raise OpenAIError(f"{param} must be a string or a list of blocks.", param=param)
    texts = []
    for block in blocks:
        kind = _kind(block, param)
        if kind not in kinds:
            raise OpenAIError(f"{param}: {kind} blocks are not supported here (text only).", param=param)
        if block.get("citations"):
            raise unsupported(f"{param}.citations", "citations")
        texts.append(str(block.get("text", "")))
    return texts


def _kind(block: Any, param: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise OpenAIError(f"{param}: each content block is an object with a type.", param=param)
    return block["type"]  # type: ignore[no-any-return]


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise unsupported(param, f"server tools ({kind!r}); give client tools with an input_schema")
    if not isinstance(tool.get("input_schema"), dict):
        raise OpenAIError(f"{param}.input_schema: a JSON schema object is required.", param=param)
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise OpenAIError('tool_choice {"type": "tool"} needs a name.', param="tool_choice")
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    if kind not in TOOL_CHOICES:
        raise OpenAIError(
            f"tool_choice.type must be auto, any, tool or none; got {kind!r}.", param="tool_choice"
        )
    return {**fields, "tool_choice": TOOL_CHOICES[kind]}


def _thinking(thinking: dict[str, Any]) -> bool:
    """Whether the template opens the thinking: adaptive (the model decides) or enabled. A budget is not
    ours (the thinking is bounded by max_tokens only), nor is leaving the thinking's text out."""
    kind = thinking.get("type")
    if thinking.get("display") not in (None, "summarized"):
        raise unsupported("thinking.display", f"thinking display {thinking.get('display')!r}")
    if kind == "disabled":
        return False
    if kind == "enabled" and thinking.get("budget_tokens") is not None:
        raise unsupported("thinking.budget_tokens", 'a thinking budget; send {"type": "adaptive"}')
    if kind not in ("adaptive", "enabled"):
        raise OpenAIError(
            f"thinking.type must be adaptive, enabled or disabled; got {kind!r}.", param="thinking.type"
        )
    return True


def _output_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """output_config.format json_schema: the structured-output path, as response_format json_schema."""
    if config.get("effort") is not None:
        raise unsupported("output_config.effort", "effort levels")
    form = config.get("format")
    if form is None:
        return None
    if (
        not isinstance(form, dict)
        or form.get("type") != "json_schema"
        or not isinstance(form.get("schema"), dict)
    ):
        raise OpenAIError(
            'output_config.format is {"type": "json_schema", "schema": {...}}.', param="output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
