"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat rendering path.

A message is rendered, planned and generated exactly as the same conversation on /v1/chat/completions
(`start_chat`), so greedy gives the same text through either door; only the shape differs: content
blocks (thinking, text, tool_use), Anthropic's stop reasons and usage, and its streaming events.
Usage follows Anthropic's split: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were (count_tokens answers their sum).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.engine.async_llm import final_state
from frontend.engine.output_processor import Delta, RequestState
from frontend.engine.pieces import Block, formatted
from frontend.openai.chat import ChatRun, start_chat
from frontend.openai.common import Serving, json_response, until_disconnected
from frontend.openai.render import chat_prompt
from frontend.server.errors import OpenAIError, anthropic_error_body, to_openai_error
from frontend.vision.loader import chat_images

from .schemas import CountTokensRequest, MessagesRequest, to_chat_request

router = APIRouter()
_encoder = msgspec.json.Encoder()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, serving: Serving) -> Response:
    chat = to_chat_request(body)
    await serving.check_model(chat.model)
    if body.thinking is not None and serving.reasoning_parser is None:
        raise OpenAIError("thinking needs a server started with --reasoning-parser.", param="thinking")
    run, stream = await start_chat(chat, request, serving, id_prefix="msg", in_order=True)
    if body.stream:
        return StreamingResponse(_events(run, stream), media_type="text/event-stream")
    state = await until_disconnected(request, final_state(stream))
    choice = state.choices[0]
    stop_reason, stop_sequence = _stop_reason(choice.reported_finish_reason, choice.stop_reason)
    return json_response(
        {
            **_message(run, _usage(state, state.num_output_tokens)),
            "content": _blocks(choice.blocks),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
        }
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, serving: Serving) -> Response:
    chat = to_chat_request(body)
    await serving.check_model(chat.model)
    model = serving.model_name(chat.model)
    images = await chat_images(serving.images, model, chat.messages)
    return json_response({"input_tokens": len(chat_prompt(serving, chat, chat.tools, images).token_ids)})


def _message(run: ChatRun, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": run.request_id, "type": "message", "role": "assistant", "model": run.model, "usage": usage}


def _usage(state: RequestState, num_output_tokens: int) -> dict[str, int]:
    cached = state.num_cached_tokens
    return {
        "input_tokens": len(state.prompt_token_ids) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": num_output_tokens,
    }


def _stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str | None, str | None]:
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn" if finish_reason == "stop" else finish_reason), None


def _blocks(blocks: list[Block]) -> list[dict[str, Any]]:
    """The content blocks in the order the model wrote them, as the stream sends them (and as Anthropic's
    API answers): text after a tool call is a text block after the tool_use block."""
    content: list[dict[str, Any]] = []
    for block in blocks:
        if block.kind == "reasoning":
            content.append({"type": "thinking", "thinking": block.text, "signature": ""})
        elif block.kind == "text":
            content.append({"type": "text", "text": block.text})
        else:
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_use_id(block.call_id),
                    "name": block.name,
                    "input": _input(block.text),
                }
            )
    return content


def _tool_use_id(call_id: str | None) -> str:
    return f"toolu_{(call_id or '').rpartition('-')[2]}"


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}  # a call cut short by max_tokens: stop_reason says so
    return value if isinstance(value, dict) else {}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode({"type": kind, **payload}) + b"\n\n"


class _Blocks:
    """The open content block of a streamed message: a new kind (or a new call) closes it and opens the
    next. (Whitespace between blocks waits in the output path, so the blocks equal the non-streamed.)"""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return [*events, _event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def delta(self, payload: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": payload})

    def reasoning(self, text: str) -> list[bytes]:
        events = (
            []
            if self.kind == "thinking"
            else self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        return [*events, self.delta({"type": "thinking_delta", "thinking": text})]

    def content(self, text: str) -> list[bytes]:
        events = [] if self.kind == "text" else self.open("text", {"type": "text", "text": ""})
        return [*events, self.delta({"type": "text_delta", "text": text})]

    def call(self, call_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        events: list[bytes] = []
        if call_id is not None:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": _tool_use_id(call_id),
                "name": name,
                "input": {},
            }
            events = self.open("tool_use", block)
        if arguments:
            events.append(self.delta({"type": "input_json_delta", "partial_json": arguments}))
        return events


async def _events(
    run: ChatRun, stream: AsyncGenerator[tuple[RequestState, Delta], None]
) -> AsyncIterator[bytes]:
    blocks, started = _Blocks(), False
    try:
        async for state, delta in stream:
            if not started:
                started = True
                message = {
                    **_message(run, _usage(state, 0)),
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                }
                yield _event("message_start", {"message": message})
                yield _event("ping", {})
            events = formatted(delta.pieces, blocks)
            if delta.finish_reason is not None:
                events += blocks.close()
                stop_reason, stop_sequence = _stop_reason(delta.finish_reason, delta.stop_reason)
                usage = _usage(state, state.num_output_tokens)
                events.append(
                    _event(
                        "message_delta",
                        {
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": usage,
                        },
                    )
                )
                events.append(_event("message_stop", {}))
            for event in events:
                yield event
    except Exception as error:
        body = anthropic_error_body(to_openai_error(error))
        yield b"event: error\ndata: " + _encoder.encode(body) + b"\n\n"
