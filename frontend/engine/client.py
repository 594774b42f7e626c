"""The one connection to the EngineCore, asyncio-based: API servers, the offline LLM and `engine bench
engine` all use it.

Two DEALER sockets connect to the engine's ROUTERs: requests go out on the input socket; outputs for
this frontend's requests (and only those) come back on the output socket, routed by its identity.
One background task reads the output socket and hands each RequestOutput to the queue of the request
it belongs to; a DEAD message (or a silent engine process) fails every open request at once. A DEAD
message is final; silence is not: if the engine speaks again (it was starved or stalled, not gone), the
client takes requests again and aborts the ones it failed, so the engine frees their blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from protocol.codec import decode_value, encode_value, engine_codec, frontend_codec
from protocol.errors import EngineDeadError, InvalidParameterError, ProtocolVersionError
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineOutputs,
    EngineSet,
    ModelInfo,
    Ready,
    Register,
    Rejected,
    RequestOutput,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("engine.frontend")

HEARTBEAT_TIMEOUT_S = 10.0  # the engine speaks every second; ten missed beats mean it is gone (default)


def connect_dealers(
    context: zmq.Context[Any], client_id: str, input_address: str, output_address: str
) -> tuple[Any, Any]:
    """A frontend's (input, output) DEALER sockets, both carrying its identity, never dropping."""
    identity = client_id.encode()
    output_socket = context.socket(zmq.DEALER)
    input_socket = context.socket(zmq.DEALER)
    for sock in (output_socket, input_socket):
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
    # Output first, so the engine can route the Ready reply as soon as it sees the Register.
    output_socket.connect(output_address)
    input_socket.connect(input_address)
    return input_socket, output_socket


class AsyncEngineClient:
    def __init__(
        self,
        input_address: str,
        output_address: str,
        client_id: str | None = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.client_id = client_id or f"api-{uuid.uuid4().hex[:12]}"
        self.heartbeat_timeout_s = heartbeat_timeout_s  # silence this long: the engine is judged gone
        self.addresses = [input_address, output_address]
        self._codec = frontend_codec()
        self._decoder = engine_codec()
        self._context = zmq.asyncio.Context()
        self._input, self._output = connect_dealers(
            self._context, self.client_id, input_address, output_address
        )
        self.model_info: ModelInfo | None = None
        self.dead_reason: str | None = None
        self._silent_since: float | None = None  # loop time of the last message before a silence death
        self._failed: list[str] = []  # requests open when the engine was declared dead
        self.last_stats: SchedulerStats | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self.last_message_at = 0.0  # loop time of the last message from the engine
        self.last_progress_at = 0.0  # loop time the engine's step count last moved (or it was idle)
        self.added_since_stats = 0  # requests sent since the last stats: not yet in num_waiting
        # engine 0's word on the data-parallel engines (elastic scaling): DataParallelClient's handler
        self.on_engine_set: Callable[[EngineSet], None] | None = None
        self.pending_engine_set: EngineSet | None = None  # one that came before a handler was set

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    async def register(self, timeout_s: float, is_alive: Callable[[], bool] | None = None) -> ModelInfo:
        """Join the engine; is_alive() (optional) ends the wait early when the engine process died."""
        await self._send(Register(PROTOCOL_VERSION, self.client_id))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            remaining_ms = int((deadline - asyncio.get_running_loop().time()) * 1000)
            if remaining_ms <= 0:
                raise TimeoutError(f"the engine did not answer registration within {timeout_s} s")
            if not await self._output.poll(min(remaining_ms, 500)):
                if is_alive is not None and not is_alive():
                    raise EngineDeadError("the engine process exited during startup (see its log above)")
                continue
            message = self._decoder.decode(await self._output.recv_multipart())
            if isinstance(message, Rejected):
                raise ProtocolVersionError(message.reason)
            if isinstance(message, EngineDead):
                raise EngineDeadError(message.reason)
            if isinstance(message, Ready):
                break  # anything else (a heartbeat that overtook the Ready) is ignored
        self.model_info = message.model_info
        loop = asyncio.get_running_loop()
        self.last_message_at = loop.time()
        self._reader = loop.create_task(self._read_outputs())
        self._watchdog = loop.create_task(self._watch_heartbeat())
        return message.model_info

    async def _watch_heartbeat(self) -> None:
        """The engine speaks at least once a second (outputs or stats); silence means it is gone."""
        loop = asyncio.get_running_loop()
        timeout_s = self.heartbeat_timeout_s
        interval = min(timeout_s / 4, 1.0)
        while True:
            slept_from = loop.time()
            await asyncio.sleep(interval)
            if loop.time() - slept_from > interval + 1.0:
                continue  # our own loop stalled: the reader gets a turn before the engine is judged
            if self._reader is not None and self._reader.done():  # it only ends by failing
                error = None if self._reader.cancelled() else self._reader.exception()
                logger.error("the engine output reader stopped", exc_info=error)
                self.mark_dead(f"the engine output reader stopped: {error!r}")
                return
            if self.dead_reason is not None:
                if self._silent_since is None:
                    return  # a final death (DEAD frame, the launcher's word): nothing left to watch
                continue  # silent: the reader revives us if the engine speaks again
            # NOTE: a message already waiting in the socket means our own loop was slow, not the engine.
            if loop.time() - self.last_message_at > timeout_s and not await self._output.poll(0):
                silent_since = self.last_message_at
                self.mark_dead(f"no message from the engine for {timeout_s:g} s")
                self._silent_since = silent_since

    async def add_request(
        self, request: AddRequest, queue: asyncio.Queue[RequestOutput | Exception] | None = None
    ) -> asyncio.Queue[RequestOutput | Exception]:
        """Send a request; its outputs go to `queue` (one queue may serve several requests)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue = queue if queue is not None else asyncio.Queue()
        self._queues[request.request_id] = queue
        self.added_since_stats += 1
        await self._send(request)
        return queue

    def engine_index(self, request_id: str) -> int:
        """The engine that runs a request: this one, rank 0 of one (DataParallelClient has several)."""
        return 0

    def release(self, request_id: str) -> None:
        """Stop routing outputs for a request (after it finished or was aborted)."""
        self._queues.pop(request_id, None)

    async def abort(self, request_ids: list[str], reason: str | None = None) -> None:
        """reason: for requests another frontend owns (a cancel), the stop_reason their owner sees."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if request_ids and self.dead_reason is None:
            await self._send(AbortRequests(request_ids, reason))

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        """End requests whichever frontend owns them: one of ours gets its abort output now, the engine
        sends the others' to their owners; either way with stop_reason `reason`."""
        for request_id in request_ids:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(RequestOutput(request_id, [], finish_reason="abort", stop_reason=reason))
        await self.abort(request_ids, reason)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._send(UtilityCall(call_id, method, [encode_value(a) for a in args]))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def mark_dead(self, reason: str) -> None:
        """Fail every open request and refuse new ones."""
        self._silent_since = None  # any death but the watchdog's own is final
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine is dead: %s", reason)
        self._failed = list(self._queues)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def _revive(self) -> None:
        """The engine spoke after a silence death: take requests again, and abort the ones failed at
        the death (their handlers are gone; the engine would run them to their length)."""
        assert self._silent_since is not None
        silence = asyncio.get_running_loop().time() - self._silent_since
        logger.warning("the engine spoke again after %.1f s of silence; taking requests again", silence)
        self.dead_reason = self._silent_since = None
        failed, self._failed = self._failed, []
        if failed:
            await self._send(AbortRequests(failed))

    async def _read_outputs(self) -> None:
        while True:
            frames = await self._output.recv_multipart()
            self.last_message_at = asyncio.get_running_loop().time()
            message = self._decoder.decode(frames)
            if self._silent_since is not None and not isinstance(message, EngineDead):
                await self._revive()
            if isinstance(message, EngineOutputs):
                if message.scheduler_stats is not None:
                    self._update_stats(message.scheduler_stats)
                for output in message.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            elif isinstance(message, UtilityResult):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    if message.error is not None and message.param is not None:
                        error = InvalidParameterError(message.param, message.error, message.code)
                        future.set_exception(error)  # the caller's input: a 400 (or 404) at the edge
                    elif message.error is not None:
                        future.set_exception(RuntimeError(message.error))
                    else:
                        future.set_result(decode_value(message.result))
            elif isinstance(message, EngineDead):
                self.mark_dead(message.reason)
            elif isinstance(message, EngineSet):
                if self.on_engine_set is not None:
                    self.on_engine_set(message)
                else:
                    self.pending_engine_set = message

    def _update_stats(self, stats: SchedulerStats) -> None:
        previous = self.last_stats
        idle = stats.num_running + stats.num_waiting == 0 or bool(stats.paused or stats.sleeping)
        if previous is None or idle or stats.num_steps != previous.num_steps:
            self.last_progress_at = asyncio.get_running_loop().time()
        self.last_stats = stats
        self.added_since_stats = 0

    def stalled_for(self) -> float:
        """Seconds the engine has held open requests without finishing a step (0 when it moves)."""
        stats = self.last_stats
        if stats is None or stats.num_running + stats.num_waiting == 0 or stats.paused or stats.sleeping:
            return 0.0  # (paused or asleep on purpose: not a stall)
        return asyncio.get_running_loop().time() - self.last_progress_at

    async def abort_all(self, reason: str) -> int:
        """End every open request now: each gets a final abort output (stop_reason `reason`), and the
        engine frees their blocks. Returns how many there were."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            self._queues[request_id].put_nowait(
                RequestOutput(request_id, [], finish_reason="abort", stop_reason=reason)
            )
        await self.abort(request_ids)
        return len(request_ids)

    async def _send(self, message: Any) -> None:
        await self._input.send_multipart(self._codec.encode(message))

    async def aclose(self) -> None:
        """close(), after the background tasks have ended (for a loop that is about to stop)."""
        tasks = [t for t in (self._reader, getattr(self, "_watchdog", None)) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.close()

    def close(self) -> None:
        for task in (self._reader, getattr(self, "_watchdog", None)):
            if task is not None:
                task.cancel()
        self._input.close()
        self._output.close()
        self._context.term()
