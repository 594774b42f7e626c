"""POST /v1/chat/completions: messages -> chat template -> engine -> chat.completion (JSON or SSE)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.engine.async_llm import final_state, new_request_id
from frontend.engine.output_processor import Delta, RequestState
from frontend.openai.common import (
    Run,
    Serving,
    caller_request_id,
    echoes_request_id,
    id_headers,
    json_response,
    metadata_of,
    until_disconnected,
)
from frontend.openai.format import SSE_DONE, chat_logprobs, prompt_logprobs_body, sse, usage
from frontend.openai.params import check_top, to_sampling_params
from frontend.openai.render import chat_prompt
from frontend.openai.schemas import ChatCompletionRequest
from frontend.openai.serving import OpenAIServing
from frontend.openai.structured import spec_of_request
from frontend.openai.tools import ChatPlan, plan_chat, select_tools
from frontend.parsers.base import Delta as ParsedDelta
from frontend.parsers.base import Parsed
from frontend.server.errors import to_openai_error
from frontend.vision.loader import chat_images
from protocol.media import MultiModalInput
from protocol.sampling import SamplingParams

router = APIRouter()
logger = logging.getLogger("engine.api")


@dataclass
class ChatRun(Run):
    """One chat request on its way: what the formatters need besides the deltas."""

    body: ChatCompletionRequest
    prompt_ids: list[int]
    num_top: int
    plan: ChatPlan
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # its images' spans (frontend/vision/)

    def logprobs(self, logprobs: Any) -> dict[str, Any] | None:
        if not self.body.logprobs or logprobs is None:
            return None
        text = self.serving.token_text
        return {"content": chat_logprobs(logprobs, self.num_top, text, self.body.return_tokens_as_token_ids)}

    @property
    def role(self) -> str:
        """vLLM's rule: --response-role, or the last message's role when no generation prompt opens a
        new turn (continue_final_message)."""
        body = self.body
        if body.add_generation_prompt and not body.continue_final_message:
            return self.serving.response_role
        return str(body.messages[-1].get("role", self.serving.response_role))

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse(self.envelope("chat.completion.chunk", choices, **extra))

    def generate(
        self, params: SamplingParams, log_id: str | None, in_order: bool = False
    ) -> AsyncGenerator[tuple[RequestState, Delta], None]:
        """in_order: the door lists the answer's blocks in order (Choice.blocks), so even a body answered
        whole is read as it comes; else a body answered whole is read once, at its end."""
        body = self.body
        return self.serving.llm.generate(
            self.request_id,
            self.prompt_ids,
            params,
            priority=body.priority,
            cache_salt=body.cache_salt,
            log_id=log_id,
            parser=self.plan if self.plan.parses else None,
            incremental=body.stream or in_order,
            lora_name=self.serving.lora_name(body.model),
            mm_inputs=self.mm_inputs,
            kv_transfer_params=body.kv_transfer_params,
        )


@router.post("/v1/chat/completions")
@echoes_request_id
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: Serving) -> Response:
    await serving.check_model(body.model)
    run, stream = await start_chat(body, request, serving)
    headers = id_headers(request, body)
    if body.stream:
        return StreamingResponse(_stream(run, stream), media_type="text/event-stream", headers=headers)
    state = await until_disconnected(request, final_state(stream))
    return json_response(full_body(run, state), headers)


async def start_chat(
    body: ChatCompletionRequest,
    request: Request,
    serving: OpenAIServing,
    id_prefix: str = "chatcmpl",
    in_order: bool = False,
    request_id: str | None = None,
) -> tuple[ChatRun, AsyncGenerator[tuple[RequestState, Delta], None]]:
    """The one rendering path of every chat-shaped door (chat completions, responses, messages, batch):
    checks, the chat template, the tool plan and the sampling params; then the generation, started.
    in_order: the door answers with the blocks in order (ChatRun.generate); request_id: the door's own
    (engine-unique), else a new one."""
    serving.admit()
    run, params = await prepare_chat(body, serving, request_id or new_request_id(id_prefix))
    if metadata := metadata_of(body):
        logger.debug("request %s metadata: %s", run.request_id, metadata)
    return run, run.generate(params, caller_request_id(request, body), in_order)


async def prepare_chat(
    body: ChatCompletionRequest, serving: OpenAIServing, request_id: str
) -> tuple[ChatRun, SamplingParams]:
    """One chat request checked, its images loaded, rendered (template, tool plan, sampling params), ready
    to generate; the batch door (chat_batch.py) runs each of its conversations through it."""
    body.check_supported()
    serving.check_priority(body.priority)
    model = serving.model_name(body.model)
    selection = select_tools(body, serving)
    images = await chat_images(serving.images, model, body.messages)
    prompt = chat_prompt(serving, body, selection.tools, images)
    prompt_ids = prompt.token_ids
    spec = spec_of_request(body, serving.validator)
    plan = plan_chat(body, serving, selection, spec, prompt.text or "")
    if plan.tool_parser is not None and plan.tool_parser.keeps_special_tokens:
        body.skip_special_tokens = False  # the parser's marker is a special token (vLLM does the same)
    top = check_top(body.top_logprobs, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = to_sampling_params(
        body,
        model_info=serving.model_info,
        defaults=serving.defaults,
        tokenizer=serving.tokenizer,
        num_prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        logprobs=(top or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        prompt_param="messages",
        structured_outputs=plan.spec,
    )
    run = ChatRun(
        serving, request_id, model, int(time.time()), body, prompt_ids, top or 0, plan, prompt.mm_inputs
    )
    return run, params


def full_body(run: ChatRun, state: RequestState) -> dict[str, Any]:
    body = run.body
    choices = []
    for choice in state.choices:
        message: dict[str, Any] = {"role": run.role, "content": choice.text}
        if run.plan.parses:
            message = full_message(choice.parsed, run.plan, body.include_reasoning, run.role)
        entry: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": run.logprobs(choice.logprobs) if body.logprobs else None,
            "finish_reason": choice.reported_finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if body.return_token_ids:
            entry["token_ids"] = choice.token_ids
        choices.append(entry)
    result = run.envelope(
        "chat.completion",
        choices,
        usage=usage(len(state.prompt_token_ids), state.num_output_tokens, state.num_cached_tokens),
    )
    if body.prompt_logprobs is not None:
        result["prompt_logprobs"] = prompt_logprobs_body(state.prompt_logprobs, run.serving.token_text)
    if body.return_token_ids:
        result["prompt_token_ids"] = state.prompt_token_ids
    if state.kv_transfer_params is not None:
        result["kv_transfer_params"] = state.kv_transfer_params
    return result


async def _stream(
    run: ChatRun, stream: AsyncGenerator[tuple[RequestState, Delta], None]
) -> AsyncIterator[bytes]:
    body = run.body
    options = body.stream_options
    include_usage = run.serving.include_usage(options)
    continuous = options is not None and options.continuous_usage_stats
    first_extra: dict[str, Any] = {"prompt_token_ids": run.prompt_ids} if body.return_token_ids else {}
    for index in range(body.n):
        role = {"index": index, "delta": {"role": run.role, "content": ""}, "logprobs": None}
        yield run.chunk([{**role, "finish_reason": None}], **(first_extra if index == 0 else {}))
    state: RequestState | None = None
    prompt_logprobs_sent = body.prompt_logprobs is None
    try:
        async for state, delta in stream:
            extra: dict[str, Any] = {}
            if continuous:
                extra["usage"] = usage(len(run.prompt_ids), state.num_output_tokens, state.num_cached_tokens)
            if not prompt_logprobs_sent and delta.index == 0 and delta.token_ids:
                extra["prompt_logprobs"] = prompt_logprobs_body(state.prompt_logprobs, run.serving.token_text)
                prompt_logprobs_sent = True
            logprobs = run.logprobs(delta.logprobs)
            content = delta_message(delta.pieces, body.include_reasoning)
            if content or logprobs is not None or (body.return_token_ids and delta.token_ids):
                piece: dict[str, Any] = {
                    "index": delta.index,
                    "delta": content or {"content": ""},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                if body.return_token_ids:
                    piece["token_ids"] = delta.token_ids
                yield run.chunk([piece], **extra)
                extra.pop("prompt_logprobs", None)
            if delta.finish_reason is not None:
                final = {
                    "index": delta.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
                yield run.chunk([final], **extra)
    except Exception as error:
        yield sse(to_openai_error(error).body())
        yield SSE_DONE
        return
    if include_usage and state is not None:
        yield run.chunk(
            [], usage=usage(len(run.prompt_ids), state.num_output_tokens, state.num_cached_tokens)
        )
    yield SSE_DONE


def full_message(
    parsed: Parsed, plan: ChatPlan, include_reasoning: bool, role: str = "assistant"
) -> dict[str, Any]:
    """The assistant message of a parsed choice: content (None when only calls came), reasoning (also as
    reasoning_content, the older name), tool calls."""
    content: str | None = parsed.content
    if parsed.calls and not parsed.content.strip():
        content = None
    message: dict[str, Any] = {"role": role, "content": content}
    if plan.reasoning_parser is not None and include_reasoning:
        reasoning = parsed.reasoning or None
        message["reasoning"] = message["reasoning_content"] = reasoning
    if plan.tool_parser is not None:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in parsed.calls
        ]
    return message


def delta_message(delta: ParsedDelta, include_reasoning: bool) -> dict[str, Any]:
    """A chunk's delta: new content, new reasoning, and each call's first piece (index, id, type, name)
    or next argument fragment."""
    message: dict[str, Any] = {}
    if delta.reasoning and include_reasoning:
        message["reasoning"] = message["reasoning_content"] = delta.reasoning
    if delta.content:
        message["content"] = delta.content
    if delta.calls:
        calls = []
        for call in delta.calls:
            function: dict[str, Any] = {"arguments": call.arguments}
            entry: dict[str, Any] = {"index": call.index, "function": function}
            if call.id is not None:
                entry.update(id=call.id, type="function")
                function["name"] = call.name
            calls.append(entry)
        message["tool_calls"] = calls
    return message
