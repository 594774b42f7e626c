"""POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's
Responses API on the chat rendering path (`start_chat`), so greedy gives the same text as the same
conversation on /v1/chat/completions.

A stored response (store: true, OpenAI's default) is kept in the ResponseStore from its start: GET shows
it in progress, cancel aborts its engine request from whichever API server it reaches (the owner sees
the abort with stop_reason "cancelled" and ends the response as cancelled)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.engine.async_llm import new_request_id
from frontend.openai.common import Serving, json_response, until_disconnected
from frontend.openai.serving import OpenAIServing
from frontend.server.errors import OpenAIError, to_openai_error

from .output import usage
from .schemas import ResponsesRequest, input_items
from .store import ResponseStore
from .tool_loop import ToolLoop

router = APIRouter()
CANCELLED = "cancelled"  # the stop_reason of a cancelled response's engine request
CANCEL_WAIT_S = 10.0  # how long a cancel waits for the owner to record the end


class Context:
    """One response on its way: its request, its turns (`ToolLoop`), and where it is kept."""

    def __init__(self, serving: OpenAIServing, body: ResponsesRequest, history: list[dict[str, Any]]) -> None:
        self.serving, self.body = serving, body
        self.history = [*history, *input_items(body.input)]  # what a continuation of it starts from
        self.created_at = int(time.time())
        self.store = serving.responses if body.store else None
        self.model = serving.model_name(body.model)
        self.loop: ToolLoop | None = None

    def response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        assert self.loop is not None
        body = self.body
        return {
            "id": self.loop.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store,
            "truncation": body.truncation or "disabled",
            "user": body.user,
            "usage": None,
            **extra,
        }

    async def keep(self, response: dict[str, Any], running: bool) -> None:
        loop = self.loop
        if self.store is not None and loop is not None:
            history = self.history + ([] if running else response["output"])
            engine_request = f"{loop.engine_request_id}-0" if running else None
            await self.store.put(response, history, engine_request)

    async def finished(self) -> dict[str, Any]:
        loop = self.loop
        assert loop is not None
        status, incomplete = loop.status
        numbers = usage(loop.num_prompt_tokens, loop.num_cached_tokens, loop.num_output_tokens)
        response = self.response(status, loop.events.items, incomplete_details=incomplete, usage=numbers)
        await self.keep(response, running=False)
        return response


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request, serving: Serving) -> Response:
    await serving.check_model(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = (await _stored(serving, body.previous_response_id, "previous_response_id")).history
    if body.store and not serving.responses.enabled:
        raise OpenAIError(
            "store is off on this server (--responses-store-max-count 0); send store: false.", param="store"
        )
    body.check_supported()
    context = Context(serving, body, history)
    loop = ToolLoop(serving, body, request, context.history, new_request_id("resp"))
    await loop.prepare(history, input_items(body.input))
    context.loop = loop
    loop.on_turn = lambda: context.keep(context.response("in_progress", loop.events.items), running=True)
    await context.keep(context.response("in_progress", []), running=True)
    if body.stream:
        return StreamingResponse(_events(context, loop), media_type="text/event-stream")
    try:
        await until_disconnected(request, _drain(loop))
    except BaseException as error:
        await _failed(context, error)
        raise
    return json_response(await context.finished())


async def _drain(loop: ToolLoop) -> None:
    async for _ in loop.run():
        pass


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, serving: Serving) -> Response:
    if request.query_params.get("stream") in ("true", "1"):
        raise OpenAIError(
            "stream is not supported when retrieving a response.", param="stream", code="unsupported_field"
        )
    return json_response((await _stored(serving, response_id, "response_id")).body)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, serving: Serving) -> Response:
    await _stored(serving, response_id, "response_id")
    await serving.responses.delete(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, serving: Serving) -> Response:
    stored = await _stored(serving, response_id, "response_id")
    if stored.body["status"] != "in_progress" or stored.engine_request_id is None:
        if stored.body["status"] == "cancelled":
            return json_response(stored.body)
        raise OpenAIError(
            f"Response {response_id} is {stored.body['status']}: only a response in progress can be cancelled.",
            param="response_id",
        )
    await serving.client.cancel([stored.engine_request_id], CANCELLED)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:  # the owner (this process or another) records the end
        stored = await _stored(serving, response_id, "response_id")
        if stored.body["status"] != "in_progress":
            return json_response(stored.body)
        await asyncio.sleep(0.05)
    return json_response({**stored.body, "status": "cancelled"})


async def _stored(serving: OpenAIServing, response_id: str, param: str) -> Any:
    stored = await serving.responses.get(response_id)
    if stored is None:
        store: ResponseStore = serving.responses
        raise OpenAIError(
            f"Response {response_id!r} not found: it was not stored (store: false), was deleted, was evicted "
            f"(this server keeps the last {store.max_count} responses, {store.max_bytes >> 20} MiB at most), "
            "or was made by a server with another store (every API server of one `engine serve` shares "
            "one; a frontend attached from elsewhere keeps its own).",
            status=404,
            type="NotFoundError",
            param=param,
            code="response_not_found",
        )
    return stored


async def _failed(context: Context, error: BaseException) -> dict[str, Any] | None:
    if context.loop is None:
        return None
    openai_error = (
        to_openai_error(error) if isinstance(error, Exception) else OpenAIError("The request was cancelled.")
    )
    failure = {"code": openai_error.code or openai_error.type, "message": openai_error.message}
    response = context.response("failed", context.loop.events.items, error=failure)
    await context.keep(response, running=False)
    return response


async def _events(context: Context, loop: ToolLoop) -> AsyncIterator[bytes]:
    events = loop.events
    start = context.response("in_progress", [])
    yield events.event("response.created", response=start)
    yield events.event("response.in_progress", response=start)
    done = False
    try:
        async for event in loop.run():
            yield event
        response = await context.finished()
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        yield events.event(kind.get(response["status"], "response.incomplete"), response=response)
        done = True
    except Exception as error:
        done = True
        yield events.event("response.failed", response=await _failed(context, error))
    finally:
        if not done:  # the client left: the stored response must not stay in progress
            await _failed(context, asyncio.CancelledError())
