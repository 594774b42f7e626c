"""OpenAI chat and completions on top of the AsyncEngineClient: validation, n > 1 fan-out, stop
strings, streaming and non-streaming responses, aborts on disconnect."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from frontend.async_client import SHUTDOWN_REASON, AsyncEngineClient
from frontend.detokenizer import IncrementalDetokenizer
from frontend.metrics import Metrics, RequestTiming
from frontend.openai_format import SSE_DONE, TokenText, chat_logprobs, completion_logprobs, sse, usage
from frontend.openai_models import ChatCompletionRequest, OpenAIError, SamplingFields
from protocol.errors import EngineDeadError, InvalidParameterError
from protocol.messages import AddRequest, ModelInfo, RequestOutput
from protocol.sampling import MAX_LOGPROBS, SamplingParams

T = TypeVar("T")

logger = logging.getLogger("engine.requests")


@dataclass
class Choice:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Any] = field(default_factory=list)


@dataclass
class Delta:
    """What one engine output added to one choice."""

    choice: Choice
    text: str
    output: RequestOutput


@dataclass
class AdmissionLimits:
    """Checked before any tokenization; 0 means no limit."""

    max_queued_requests: int = 0  # engine-wide waiting requests (the engine's stats + ours since them)
    max_queued_tokens: int = 0  # engine-wide prompt tokens waiting
    max_inflight_requests: int = 0  # this API server's open engine requests
    max_messages: int = 2048  # chat messages per request
    max_prompts: int = 1024  # prompts per completions request
    retry_after_s: int = 1


class OpenAIServing:
    def __init__(
        self,
        client: AsyncEngineClient,
        tokenizer: Any,
        model_info: ModelInfo,
        chat_template: str | None,
        defaults: dict[str, Any] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.chat_template = chat_template
        self.token_text = TokenText(tokenizer)
        self.defaults = defaults or {}  # generation-config values for fields a request leaves unset
        self.metrics = metrics
        self.log_requests = True
        self.limits = AdmissionLimits()
        self.draining = False  # set on SIGTERM: new requests get 503, open ones may finish

    def admit(self) -> None:
        """Refuse new work the server cannot take, before paying for templates or tokenization."""
        limits, client = self.limits, self.client
        stats = client.last_stats
        waiting = (stats.num_waiting if stats else 0) + client.added_since_stats
        waiting_tokens = stats.num_waiting_tokens if stats else 0
        refusal = None
        if self.draining:
            refusal = (
                503,
                "service_unavailable_error",
                "server_shutting_down",
                "The server is shutting down.",
            )
        elif limits.max_inflight_requests and client.num_open_requests >= limits.max_inflight_requests:
            refusal = (
                429,
                "rate_limit_error",
                "too_many_requests",
                f"This API server has {client.num_open_requests} requests in flight, its limit is "
                f"{limits.max_inflight_requests}. Retry later.",
            )
        elif limits.max_queued_requests and waiting >= limits.max_queued_requests:
            refusal = (
                503,
                "service_unavailable_error",
                "queue_full",
                f"The engine queue is full ({waiting} requests waiting, limit {limits.max_queued_requests}). "
                "Retry later.",
            )
        elif limits.max_queued_tokens and waiting_tokens >= limits.max_queued_tokens:
            refusal = (
                503,
                "service_unavailable_error",
                "queue_full",
                f"The engine queue is full ({waiting_tokens} prompt tokens waiting, limit "
                f"{limits.max_queued_tokens}). Retry later.",
            )
        if refusal is not None:
            status, kind, code, message = refusal
            retry = {"Retry-After": str(limits.retry_after_s)}
            raise OpenAIError(message, status=status, type=kind, code=code, headers=retry)

    # ---- shared validation ----

    def model_name(self, requested: str | None) -> str:
        names = self.model_info.served_model_names
        if requested is None or requested in names:
            return requested or names[0]
        raise OpenAIError(
            f"The model `{requested}` does not exist.",
            status=404,
            type="NotFoundError",
            param="model",
            code="model_not_found",
        )

    def sampling_params(
        self, request: SamplingFields, num_prompt_tokens: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        limit = self.model_info.max_model_len
        if max_tokens is None and "max_tokens" in self.defaults:
            max_tokens = min(int(self.defaults["max_tokens"]), max(limit - num_prompt_tokens, 1))
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if num_prompt_tokens + (max_tokens or 0) > limit or num_prompt_tokens >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + (max_tokens or 0)} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the messages or completion.",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        try:
            bias = {int(k): float(v) for k, v in (request.logit_bias or {}).items()}
        except ValueError as error:
            raise OpenAIError("logit_bias keys must be token ids.", param="logit_bias") from error
        params = SamplingParams(
            n=request.n,
            temperature=self._field(request.temperature, "temperature", 1.0),
            top_p=self._field(request.top_p, "top_p", 1.0),
            top_k=self._field(request.top_k, "top_k", 0),
            min_p=self._field(request.min_p, "min_p", 0.0),
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=self._field(request.repetition_penalty, "repetition_penalty", 1.0),
            logit_bias=bias or None,
            max_tokens=max_tokens if max_tokens is not None else limit - num_prompt_tokens,
            min_tokens=request.min_tokens,
            stop=stop,
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
        )
        try:
            params.validate(self.model_info.vocab_size)
        except InvalidParameterError as error:
            raise OpenAIError(error.message, param=error.param) from error
        return params

    def _field(self, value: Any, name: str, fallback: Any) -> Any:
        """The request's value, else the generation config's, else the OpenAI default."""
        return value if value is not None else self.defaults.get(name, fallback)

    # ---- generation ----

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int
    ) -> AsyncGenerator[Delta, None]:
        """Run the n choices of one prompt; yield each piece of new text as it comes."""
        if self.log_requests and logger.isEnabledFor(logging.DEBUG):
            shown = self.tokenizer.decode(prompt_ids[:64]) if self.tokenizer is not None else prompt_ids[:64]
            logger.debug(
                "request %s: %d prompt tokens %r%s, n=%d, max_tokens=%s, temperature=%s",
                request_id,
                len(prompt_ids),
                shown,
                "..." if len(prompt_ids) > 64 else "",
                params.n,
                params.max_tokens,
                params.temperature,
            )
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        choices: dict[str, Choice] = {}
        for index in range(params.n):
            child_id = f"{request_id}-{index}"
            choices[child_id] = Choice(index, IncrementalDetokenizer(self.tokenizer, params))
            await self.client.add_request(
                AddRequest(
                    request_id=child_id,
                    prompt_token_ids=prompt_ids,
                    sampling_params=params.for_choice(index),
                    arrival_time=time.time(),
                    priority=priority,
                ),
                queue,
            )
        open_ids = set(choices)
        timings = {child_id: RequestTiming(time.monotonic()) for child_id in choices}
        try:
            while open_ids:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                choice = choices.get(item.request_id)
                if choice is None or item.request_id not in open_ids:
                    continue
                drained = item.finish_reason == "abort" and item.stop_reason == SHUTDOWN_REASON
                if (
                    item.finish_reason == "abort"
                    and isinstance(item.stop_reason, str)
                    and not item.new_token_ids
                    and not drained
                ):
                    raise OpenAIError(f"The engine rejected the request: {item.stop_reason}", param="prompt")
                finished = item.finish_reason is not None
                text = choice.detokenizer.update(item.new_token_ids, finished)
                choice.token_ids.extend(item.new_token_ids)
                if self.metrics is not None:
                    self.metrics.observe_token(
                        timings[item.request_id], time.monotonic(), len(item.new_token_ids)
                    )
                if choice.detokenizer.stop_matched is not None:
                    choice.finish_reason, choice.stop_reason = "stop", choice.detokenizer.stop_matched
                    if not finished:
                        await self.client.abort([item.request_id])
                    finished = True
                elif finished:
                    choice.finish_reason, choice.stop_reason = item.finish_reason, item.stop_reason
                    if choice.finish_reason == "abort" and not drained:
                        raise EngineDeadError("the engine aborted the request")
                choice.text += text
                if finished:
                    open_ids.discard(item.request_id)
                    self.client.release(item.request_id)
                    if self.metrics is not None and choice.finish_reason is not None:
                        self.metrics.observe_finished(
                            timings[item.request_id],
                            item,
                            choice.finish_reason,
                            len(prompt_ids),
                            len(choice.token_ids),
                            time.monotonic(),
                        )
                yield Delta(choice, text, item)
        finally:
            if open_ids:
                await self.client.abort(sorted(open_ids))


async def merged(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's index. Closing the merged
    stream (the client left) closes or cancels every stream still running, which runs their cleanup
    (aborts)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    # (stream, (item,)) for an item, (stream, error) for a failure, (stream, None) when it is done
    queue: asyncio.Queue[tuple[int, tuple[T] | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, (item,)))
        except Exception as error:
            await queue.put((index, error))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            if event is None:
                running -= 1
                continue
            yield index, event[0]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def new_id(prefix: str, header_id: str | None) -> str:
    return f"{prefix}-{header_id or uuid.uuid4().hex}"


def engine_error(error: Exception) -> OpenAIError:
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return OpenAIError(
            f"The engine is not available: {error}",
            status=503,
            type="service_unavailable_error",
            code="engine_dead",
        )
    if isinstance(error, InvalidParameterError):
        return OpenAIError(error.message, param=error.param)
    logger.error("internal error while serving a request", exc_info=error)
    return OpenAIError(f"Internal error: {type(error).__name__}: {error}", status=500, type="internal_error")


def clamp_top(value: int | None, param: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}.", param=param)
    return value


__all__ = [
    "SSE_DONE",
    "Choice",
    "Delta",
    "OpenAIServing",
    "chat_logprobs",
    "clamp_top",
    "completion_logprobs",
    "engine_error",
    "merged",
    "new_id",
    "sse",
    "usage",
]
