"""POST /v1/chat/completions and /v1/completions: request -> prompt ids -> engine -> OpenAI bodies."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from frontend.openai_format import (
    SSE_DONE,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    sse,
    usage,
)
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, OpenAIError
from frontend.serving import OpenAIServing, clamp_top, engine_error, merged, new_id

router = APIRouter()


async def get_serving(request: Request) -> OpenAIServing:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop for every request.
    return request.app.state.deps.serving  # type: ignore[no-any-return]


Serving = Annotated[OpenAIServing, Depends(get_serving)]


def json_response(body: Any, headers: dict[str, str] | None = None) -> Response:
    import msgspec

    return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)


async def until_disconnected(request: Request, work: Any) -> Any:
    """Await `work` (a non-streaming generation); if the client goes away first, cancel it, which
    aborts its engine requests (their blocks are freed)."""
    task = asyncio.ensure_future(work)
    # NOTE: the body is already read, so the next ASGI message is the disconnect (as in Starlette's
    # StreamingResponse); Request.is_disconnected() uses a cancel scope that can leak cancellations.
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise OpenAIError("The client disconnected.", status=499, type="client_closed_request")
        return task.result()
    except OpenAIError:
        raise
    except Exception as error:
        raise engine_error(error) from error
    finally:
        for pending in (task, disconnect):
            if not pending.done():
                pending.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def chat_prompt(serving: OpenAIServing, body: ChatCompletionRequest) -> list[int]:
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
    messages = []
    for message in body.messages:
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise OpenAIError("Only text content parts are supported.", param="messages")
                texts.append(str(part.get("text", "")))
            message = {**message, "content": "".join(texts)}
        messages.append(message)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            chat_template=body.chat_template or serving.chat_template,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as error:  # template errors are the caller's input
        raise OpenAIError(f"Could not apply the chat template: {error}", param="messages") from error
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: Serving) -> Response:
    serving.admit()
    model = serving.model_name(body.model)
    prompt_ids = chat_prompt(serving, body)
    top = clamp_top(body.top_logprobs, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = serving.sampling_params(body, len(prompt_ids), max_tokens, (top or 0) if body.logprobs else None)
    request_id = new_id("chatcmpl", request.headers.get("x-request-id"))
    created = int(time.time())
    stream = serving.generate(request_id, prompt_ids, params, body.priority)
    if body.stream:
        return StreamingResponse(
            _chat_stream(serving, stream, body, request_id, model, created, len(prompt_ids), top or 0),
            media_type="text/event-stream",
        )
    choices: dict[int, Any] = {}
    cached = 0

    async def collect() -> None:
        nonlocal cached
        async for delta in stream:
            choices[delta.choice.index] = delta.choice
            cached = delta.output.num_cached_tokens
            if body.logprobs and delta.output.new_logprobs is not None:
                delta.choice.logprobs.extend(
                    chat_logprobs(delta.output.new_logprobs, top or 0, serving.token_text)
                )

    await until_disconnected(request, collect())
    num_completion = sum(len(c.token_ids) for c in choices.values())
    return json_response(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": c.logprobs} if body.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in sorted(choices.values(), key=lambda c: c.index)
            ],
            "usage": usage(len(prompt_ids), num_completion, cached),
        }
    )


async def _chat_stream(
    serving, stream, body, request_id, model, created, num_prompt, top
) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
    def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        payload = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        return sse({**payload, **(extra or {})})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    for index in range(body.n):
        yield chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    completion_tokens, cached = 0, 0
    try:
        async for delta in stream:
            completion_tokens += len(delta.output.new_token_ids)
            cached = delta.output.num_cached_tokens
            logprobs = None
            if body.logprobs and delta.output.new_logprobs is not None:
                logprobs = {"content": chat_logprobs(delta.output.new_logprobs, top, serving.token_text)}
            extra = {"usage": usage(num_prompt, completion_tokens, cached)} if continuous else None
            if delta.text or logprobs is not None:
                yield chunk(
                    [
                        {
                            "index": delta.choice.index,
                            "delta": {"content": delta.text},
                            "logprobs": logprobs,
                            "finish_reason": None,
                        }
                    ],
                    extra,
                )
            if delta.choice.finish_reason is not None:
                final = {
                    "index": delta.choice.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": delta.choice.finish_reason,
                    "stop_reason": delta.choice.stop_reason,
                }
                yield chunk([final], extra)
    except Exception as error:
        yield sse(engine_error(error).body())
        yield SSE_DONE
        return
    if include_usage:
        yield chunk([], {"usage": usage(num_prompt, completion_tokens, cached)})
    yield SSE_DONE


def completion_prompts(serving: OpenAIServing, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise OpenAIError("prompt must not be empty.", param="prompt")
    if len(prompts) > serving.limits.max_prompts:
        raise OpenAIError(
            f"at most {serving.limits.max_prompts} prompts per request, got {len(prompts)}.", param="prompt"
        )
    result = []
    for item in prompts:
        if isinstance(item, str):
            if serving.tokenizer is None:
                raise OpenAIError("This model has no tokenizer: send token ids.", param="prompt")
            result.append((item, list(serving.tokenizer(item)["input_ids"])))
        else:
            if not item:
                raise OpenAIError("prompt must not be empty.", param="prompt")
            if any(not 0 <= t < serving.model_info.vocab_size for t in item):
                raise OpenAIError(
                    f"token ids must be in [0, {serving.model_info.vocab_size}).", param="prompt"
                )
            # The prompt's text is only ever sent back by echo.
            text = serving.tokenizer.decode(item) if body.echo and serving.tokenizer is not None else None
            result.append((text, list(item)))
    return result


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, serving: Serving) -> Response:
    serving.admit()
    model = serving.model_name(body.model)
    if body.suffix:
        raise OpenAIError("suffix is not supported.", param="suffix")
    prompts = completion_prompts(serving, body)
    top = clamp_top(body.logprobs, "logprobs")
    params_list = [serving.sampling_params(body, len(ids), body.max_tokens, top) for _, ids in prompts]
    request_id = new_id("cmpl", request.headers.get("x-request-id"))
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _completion_stream(serving, body, prompts, params_list, request_id, model, created, top),
            media_type="text/event-stream",
        )

    async def collect(
        p: int, text: str | None, ids: list[int], params: Any
    ) -> tuple[list[dict[str, Any]], int]:
        done: dict[int, Any] = {}
        logprobs: dict[int, Any] = {}
        cached = 0
        async for delta in serving.generate(f"{request_id}-{p}", ids, params, body.priority):
            done[delta.choice.index] = delta.choice
            cached = delta.output.num_cached_tokens
            if top is not None and delta.output.new_logprobs is not None:
                part = completion_logprobs(delta.output.new_logprobs, top, serving.token_text, 0)
                logprobs[delta.choice.index] = merge_completion_logprobs(
                    logprobs.get(delta.choice.index), part
                )
        prefix = (text or "") if body.echo else ""
        return [
            {
                "index": p * body.n + c.index,
                "text": prefix + c.text,
                "logprobs": logprobs.get(c.index),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "num_tokens": len(c.token_ids),
            }
            for c in sorted(done.values(), key=lambda c: c.index)
        ], cached

    # Every prompt of the request runs at once, so the engine batches them.
    results = await until_disconnected(
        request,
        asyncio.gather(
            *(
                collect(p, text, ids, params)
                for p, ((text, ids), params) in enumerate(zip(prompts, params_list, strict=True))
            )
        ),
    )
    choices = [choice for per_prompt, _ in results for choice in per_prompt]
    total_prompt = sum(len(ids) for _, ids in prompts)
    total_completion = sum(choice.pop("num_tokens") for choice in choices)
    cached = sum(c for _, c in results)
    return json_response(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(total_prompt, total_completion, cached),
        }
    )


async def _completion_stream(
    serving, body, prompts, params_list, request_id, model, created, top
) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
    def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        payload = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }
        return sse({**payload, **(extra or {})})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    total_prompt = sum(len(ids) for _, ids in prompts)
    total_completion = 0
    cached: dict[int, int] = {}
    try:
        for p, (text, _) in enumerate(prompts):
            if body.echo and text:
                for index in range(body.n):
                    yield chunk(
                        [{"index": p * body.n + index, "text": text, "logprobs": None, "finish_reason": None}]
                    )
        # Every prompt runs at once (the engine batches them), their chunks interleaved as they come.
        streams = [
            serving.generate(f"{request_id}-{p}", ids, params, body.priority)
            for p, ((_, ids), params) in enumerate(zip(prompts, params_list, strict=True))
        ]
        async for p, delta in merged(streams):
            total_completion += len(delta.output.new_token_ids)
            logprobs = None
            if top is not None and delta.output.new_logprobs is not None:
                logprobs = completion_logprobs(delta.output.new_logprobs, top, serving.token_text, 0)
            index = p * body.n + delta.choice.index
            if delta.text or logprobs is not None or delta.choice.finish_reason is not None:
                yield chunk(
                    [
                        {
                            "index": index,
                            "text": delta.text,
                            "logprobs": logprobs,
                            "finish_reason": delta.choice.finish_reason,
                            "stop_reason": delta.choice.stop_reason,
                        }
                    ]
                )
            if delta.choice.finish_reason is not None:
                cached[p] = delta.output.num_cached_tokens
    except Exception as error:
        yield sse(engine_error(error).body())
        yield SSE_DONE
        return
    if include_usage:
        yield chunk([], {"usage": usage(total_prompt, total_completion, sum(cached.values()))})
    yield SSE_DONE
