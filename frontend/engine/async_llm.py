"""AsyncLLM: run prompts on the engine and stream their deltas, for every door and the offline `LLM`.

It joins the one engine client (sockets, routing, liveness) and the one output processor (text,
stops, logprobs, finish reasons). Closing a generation early (the client left, a stop string matched)
aborts its engine requests, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from contextlib import aclosing
from typing import Any, TypeVar

from frontend.engine.data_parallel import EngineClient
from frontend.engine.output_processor import Delta, OutputProcessor, RequestState
from frontend.engine.pieces import TextParser
from frontend.metrics import Metrics
from protocol.errors import EngineDeadError, InvalidParameterError, RequestAbortedError
from protocol.media import EncoderInput, MultiModalInput
from protocol.messages import AddRequest, RequestOutput
from protocol.pooling import PooledOutput, PoolingParams
from protocol.sampling import SamplingParams

T = TypeVar("T")

logger = logging.getLogger("engine.requests")


def new_request_id(prefix: str) -> str:
    """An engine-unique id: never a caller's X-Request-Id, which two callers may share."""
    return f"{prefix}-{uuid.uuid4().hex}"


class AsyncLLM:
    def __init__(self, client: EngineClient, tokenizer: Any | None, metrics: Metrics | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, metrics)
        self.log_requests = True
        self.max_log_len: int | None = None  # prompt characters and ids a request's log line shows

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        log_id: str | None = None,
        parser: TextParser | None = None,
        incremental: bool = True,
        lora_name: str | None = None,
        encoder_input: EncoderInput | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[tuple[RequestState, Delta], None]:
        """Run the n choices of one prompt; yield each delta as it comes, with the request's state.
        parser, incremental: how the door reads the text (OutputProcessor.add_request); lora_name: the
        adapter it runs with (None: the base model); encoder_input: an encoder-decoder model's input (the
        audio's features), shared by the n choices; mm_inputs: a vision-language model's images;
        kv_transfer_params: vLLM's (docs/scale-out.md), the finished request's in RequestState."""
        state, requests = self.processor.add_request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            parser=parser,
            incremental=incremental,
            lora_name=lora_name,
            encoder_input=encoder_input,
            mm_inputs=mm_inputs,
            kv_transfer_params=kv_transfer_params,
        )
        self._log(state, log_id)
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        try:
            for request in requests:
                await self.client.add_request(request, queue)
            state.engine_index = self.client.engine_index(requests[0].request_id)
            while not state.finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                delta = self.processor.process(state, item)
                if delta is None:
                    continue
                if delta.finish_reason is not None:
                    self.client.release(item.request_id)
                    if delta.abort:
                        await self.client.abort([item.request_id])
                yield state, delta
        finally:
            if open_ids := state.open_child_ids:
                await self.client.abort(open_ids)

    async def encode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> PooledOutput:
        """Run one pooling request (prefill only) to its pooled value. Raises InvalidParameterError when the
        engine refused it and EngineDeadError when it ended without one."""
        request = AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=1),
            arrival_time=time.time(),
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=params,
            lora_name=lora_name,
        )
        started = time.monotonic()
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        finished = False
        try:
            await self.client.add_request(request, queue)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise InvalidParameterError(item.error.param, item.error.message, item.error.code)
                if item.finish_reason is None:
                    continue
                finished = True
                engine = self.client.engine_index(request_id)  # (a released request has none)
                self.client.release(request_id)
                if item.pooled is None:
                    if item.finish_reason == "abort" and item.stop_reason is not None:
                        raise RequestAbortedError(str(item.stop_reason))  # a drain or a cancel, on purpose
                    raise EngineDeadError(f"the engine ended the pooling request ({item.finish_reason})")
                if self.processor.metrics is not None:
                    metrics = self.processor.metrics
                    metrics.observe_pooling(
                        started, item, len(prompt_token_ids), params.task, lora_name, engine
                    )
                return item.pooled
        finally:
            if not finished:
                await self.client.abort([request_id])

    def _log(self, state: RequestState, log_id: str | None) -> None:
        if not (self.log_requests and logger.isEnabledFor(logging.DEBUG)):
            return
        ids, params, limit = state.prompt_token_ids, state.params, self.max_log_len
        text = self.tokenizer.decode(ids[:limit]) if self.tokenizer is not None else None
        if text is not None and limit is not None:
            text = text[:limit]
        logger.debug(
            "request %s%s: %d prompt tokens, prompt %r, ids %s%s, n=%d, max_tokens=%s, temperature=%s",
            state.request_id,
            f" (X-Request-Id {log_id})" if log_id else "",
            len(ids),
            text,
            ids[:limit],
            "..." if limit is not None and len(ids) > limit else "",
            params.n,
            params.max_tokens,
            params.temperature,
        )


async def final_state(stream: AsyncGenerator[tuple[RequestState, Delta], None]) -> RequestState:
    """Run a generation to its end (a non-streaming request); its state, every choice finished."""
    state = None
    async for item in stream:
        state = item[0]
    if state is None:
        raise EngineDeadError("the engine ended the request without an output")
    return state


async def gather_all(work: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run every coroutine at once; the first failure (or our cancellation) cancels the rest, which
    aborts their engine requests."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
