"""Prompt rendering: a chat conversation through the chat template, or completions prompts (text or
token ids), to prompt token ids, validated against the model's vocabulary and limits."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from frontend.openai.params import truncate_prompt
from frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from frontend.openai.serving import OpenAIServing
from frontend.server.errors import OpenAIError
from frontend.vision.parts import template_content
from frontend.vision.processing import ProcessedImage
from protocol.media import MultiModalInput


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the prompt's text, when it had one or echo needs it
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # its images' spans (frontend/vision/)


def chat_prompt(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    images: list[ProcessedImage] | None = None,
) -> Prompt:
    """tools: what the template shows (default body.tools; the legacy `functions`, mapped, otherwise).
    images: the conversation's, loaded (frontend/vision/loader.py): a vision-language model's template sees
    content lists with image parts, and the prompt's image tokens become the images' spans."""
    tools = body.tools if tools is None else tools
    if not body.messages:
        raise OpenAIError("messages must not be empty.", param="messages")
    if len(body.messages) > serving.limits.max_messages:
        raise OpenAIError(
            f"at most {serving.limits.max_messages} messages per request, got {len(body.messages)}.",
            param="messages",
        )
    tokenizer = serving.tokenizer
    if tokenizer is None:
        raise OpenAIError(
            "This model has no tokenizer: use /v1/completions with token ids.", param="messages"
        )
    for index, message in enumerate(body.messages):
        _check_content(
            message, index, continued=body.continue_final_message and index == len(body.messages) - 1
        )
    vision = serving.images is not None
    messages = [_message_for_template(message, index, vision) for index, message in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            chat_template=body.chat_template or serving.chat_template,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            # vLLM's default: the tools are in the prompt even with tool_choice "none"
            **({"tools": tools} if tools else {}),
            **(body.chat_template_kwargs or {}),
        )
    except Exception as error:  # template errors are the caller's input
        raise OpenAIError(f"Could not apply the chat template: {error}", param="messages") from error
    if serving.images is None:
        ids = list(tokenizer(text, add_special_tokens=body.add_special_tokens)["input_ids"])
        return Prompt(truncate_prompt(ids, body, serving.model_info.max_model_len), text)
    try:  # each image's text in place of its token, then tokenized whole (frontend/vision/processing.py)
        ids, items = serving.images.model.prompt(
            text,
            images or [],
            lambda prompt: list(tokenizer(prompt, add_special_tokens=body.add_special_tokens)["input_ids"]),
        )
    except ValueError as error:
        raise OpenAIError(str(error), param="messages") from None
    if body.truncate_prompt_tokens is not None and items:
        raise OpenAIError(
            "truncate_prompt_tokens would cut images out of the prompt.", param="truncate_prompt_tokens"
        )
    return Prompt(truncate_prompt(ids, body, serving.model_info.max_model_len), text, items)


def _check_content(message: dict[str, Any], index: int, *, continued: bool) -> None:
    """OpenAI's rule (and vLLM's): every message has content, except an assistant turn that carries its
    tool calls (or the legacy function call) and, as vLLM allows, the assistant turn being continued.
    A missing or null content of any other turn is a 400 naming it, never a turn rendered empty."""
    if message.get("content") is not None:
        return
    if message.get("role") == "assistant" and (
        message.get("tool_calls") or message.get("function_call") or continued
    ):
        return
    param = f"messages[{index}].content"
    raise OpenAIError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _message_for_template(message: dict[str, Any], index: int, vision: bool) -> dict[str, Any]:
    """A message as chat templates expect it (vLLM's rendering): content a string, so that a template that
    concatenates it works on the SDK's `{"role": "assistant", "content": null, "tool_calls": [...]}` turn
    (its null or missing content is ""; text parts are joined with newlines); a vision-language model's
    content parts as a list of text and image parts (its template places the image tokens); tool calls'
    arguments as objects."""
    content = message.get("content")
    if content is None:
        content = ""
    elif vision:  # a string too: these templates read the content as parts (vLLM's "openai" format)
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        content = template_content(parts, f"messages[{index}].content")
    elif isinstance(content, list):  # content parts: text ones only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"Only text content parts are supported, got {kind!r}.", param="messages")
            texts.append(str(part.get("text", "")))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise OpenAIError("message content must be a string or a list of parts.", param="messages")
    message = {**message, "content": content}
    if message.get("role") == "assistant" and message.get("tool_calls"):
        message["tool_calls"] = [_call_for_template(call) for call in message["tool_calls"]]
    return message


def _call_for_template(call: Any) -> Any:
    """An assistant turn's tool call with its arguments as an object: templates (Qwen's, Llama's) write
    `arguments | tojson`, and a JSON string would be encoded twice (vLLM does the same)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise OpenAIError("an assistant tool call needs a function object.", param="messages")
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise OpenAIError(f"tool call arguments are not JSON: {error}", param="messages") from error
    return {**call, "function": {**call["function"], "arguments": arguments}}


def completion_prompts(serving: OpenAIServing, body: CompletionRequest) -> list[Prompt]:
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise OpenAIError("prompt must not be empty.", param="prompt")
    if len(items) > serving.limits.max_prompts:
        raise OpenAIError(
            f"at most {serving.limits.max_prompts} prompts per request, got {len(items)}.", param="prompt"
        )
    vocab_size, limit = serving.model_info.vocab_size, serving.model_info.max_model_len
    result = []
    for item in items:
        if isinstance(item, str):
            tokenizer = serving.require_tokenizer("prompt")
            ids = list(tokenizer(item, add_special_tokens=body.add_special_tokens)["input_ids"])
        else:
            if not item:
                raise OpenAIError("prompt must not be empty.", param="prompt")
            if any(not 0 <= t < vocab_size for t in item):
                raise OpenAIError(f"token ids must be in [0, {vocab_size}).", param="prompt")
            ids = list(item)
        truncated = truncate_prompt(ids, body, limit)
        text = item if isinstance(item, str) and truncated is ids else None
        if text is None and body.echo and serving.tokenizer is not None:
            text = serving.tokenizer.decode(truncated)  # only ever sent back by echo
        result.append(Prompt(truncated, text))
    return result
