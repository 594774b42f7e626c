"""The EngineCore process: two IO threads around the busy loop.

The input thread receives, decodes and queues frontend messages; the output thread encodes and
routes outputs to the frontend that owns each request. The busy loop never touches a socket, so
serialization overlaps model execution.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from engine_core.engine_core import EngineCore
from engine_core.request import Request
from engine_core.utilities import STATE_CHANGES
from protocol.codec import decode_value, encode_value, engine_codec, frontend_codec
from protocol.config import EngineConfig
from protocol.errors import InvalidParameterError
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineAnnounce,
    EngineDead,
    EngineOutputs,
    EngineSet,
    Ready,
    Register,
    Rejected,
    RequestError,
    RequestOutput,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("engine.core")

# How long the output thread keeps retrying a handshake (Ready/Rejected) to a frontend whose output
# socket is not connected yet.
ROUTE_RETRY_S = 10.0
# Silence after which every frontend gets a stats-only EngineOutputs: fresh gauges when idle, and a
# heartbeat that lets frontends tell a dead engine (no DEAD frame after SIGKILL) from an idle one.
HEARTBEAT_INTERVAL_S = 1.0
# A gap in the output thread's turns (or a step) this long is logged: it is what makes frontends judge
# the engine dead.
STARVED_S = 5.0
# When the engine wakes from idle, it keeps taking requests until none has come for BURST_GAP_S, for at
# most BURST_WINDOW_S, so that a burst shares its first step. Clients send bursts (a wave of chat turns,
# a benchmark's first requests) that reach the engine a few ms apart; without the wait the first request
# was prefilled alone and the other 15 of a c=16 wave waited for that step (served c=16, 2026-11-30: a
# 100-token step of 52-75 ms, sometimes a decode step, then the 1,500 tokens of the rest).
BURST_GAP_S = 0.003
BURST_WINDOW_S = 0.030


def bind_frontend_sockets(config: EngineConfig) -> tuple[Any, Any, Any]:
    """The ZMQ context and the frontends' (input, output) ROUTER sockets, bound. The engine process binds
    them before its worker loads: frontends that connect meanwhile (its API servers, started beside it)
    are connected when it is ready, and their Register waits in the socket, where ZMQ's retry of a
    connect to an address nobody listens on (every 100 ms) made each of them up to 0.1 s later."""
    context = zmq.Context()
    input_socket, output_socket = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
    for sock in (input_socket, output_socket):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
    output_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    input_socket.bind(config.input_address)
    output_socket.bind(config.output_address)
    return context, input_socket, output_socket


class EngineCoreProc:
    def __init__(
        self, config: EngineConfig, engine: EngineCore, sockets: tuple[Any, Any, Any] | None = None
    ) -> None:
        """sockets: bind_frontend_sockets' (bound here when not given)."""
        self.config = config
        self.engine = engine
        self.context, self.input_socket, self.output_socket = sockets or bind_frontend_sockets(config)
        # SimpleQueue: its put is reentrant, so a signal handler may wake the busy loop through it
        self.input_queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.output_queue: queue.Queue[tuple[str, msgspec.Struct] | None] = queue.Queue()
        self.clients: set[str] = set()
        self.stop_event = threading.Event()
        self.parent_pid = os.getppid()
        self._last_log_time = time.monotonic()
        self._last_log_stats = engine.make_stats()
        self.latest_stats = self._last_log_stats  # the busy loop's latest; the output thread sends it
        # data parallel: every engine's addresses (engine 0 learns those on other machines as they
        # announce themselves) and the registrations waiting for them
        self.addresses = [list(pair) for pair in config.data_parallel_addresses]
        self.scaling = (
            False  # an elastic scale is under way (engine 0: set by the launcher, told to frontends)
        )
        self.pending: list[str] = []
        self.announcer = None
        if config.data_parallel_head:
            self.announcer = self.context.socket(zmq.DEALER)
            self.announcer.setsockopt(zmq.LINGER, 0)
            self.announcer.setsockopt(zmq.IDENTITY, f"engine-{config.data_parallel_rank}".encode())
            self.announcer.connect(config.data_parallel_head)
            announce = EngineAnnounce(
                PROTOCOL_VERSION, config.data_parallel_rank, config.input_address, config.output_address
            )
            self.announcer.send_multipart(frontend_codec().encode(announce))  # queued until it connects
        self.input_thread = threading.Thread(target=self._input_loop, name="engine-input", daemon=True)
        self.output_thread = threading.Thread(target=self._output_loop, name="engine-output", daemon=True)

    # ---- IO threads ----

    def _input_loop(self) -> None:
        codec = frontend_codec()
        while not self.stop_event.is_set():
            if not self.input_socket.poll(100):
                continue
            identity, *frames = self.input_socket.recv_multipart()
            client_id = identity.decode()
            try:
                message = codec.decode(frames)
            except msgspec.DecodeError as error:
                logger.warning("dropping an undecodable message from %s: %s", client_id, error)
                continue
            if isinstance(message, Register):
                self._register(client_id, message)
            elif isinstance(message, EngineAnnounce):
                self._announced(message)
            else:
                self.input_queue.put((client_id, message))

    def _register(self, client_id: str, message: Register) -> None:
        if message.protocol_version != PROTOCOL_VERSION:
            reason = f"protocol version {message.protocol_version} != engine's {PROTOCOL_VERSION}"
            self.output_queue.put((client_id, Rejected(reason)))
            return
        if any(not address for pair in self.addresses for address in pair):
            missing = [rank for rank, pair in enumerate(self.addresses) if not all(pair)]
            logger.info(
                "frontend %s waits for data-parallel engines %s to announce themselves", client_id, missing
            )
            self.pending.append(client_id)
            return
        self.clients.add(client_id)
        logger.info("frontend %s registered", client_id)
        info = self.engine.model_info
        if self.addresses:
            info = msgspec.structs.replace(info, data_parallel_addresses=self.addresses)
        self.output_queue.put((client_id, Ready(PROTOCOL_VERSION, info)))
        if self.scaling:
            self.output_queue.put((client_id, EngineSet(self.addresses, self.scaling)))

    def _set_engine_set(self, addresses: list[list[str]], scaling: bool) -> dict[str, Any]:
        """Elastic data parallel (engine 0, from the launcher): the engines now, and whether a change is under
        way; every frontend is told, and later registrations are answered with it."""
        if not self.addresses:
            raise InvalidParameterError("addresses", "this engine was not started for elastic data parallel")
        if not addresses or not all(isinstance(p, list) and len(p) == 2 and all(p) for p in addresses):
            raise InvalidParameterError("addresses", "a list of [input, output] addresses, engine 0's first")
        self.addresses, self.scaling = [list(pair) for pair in addresses], bool(scaling)
        logger.info("data-parallel engines: %d%s", len(self.addresses), " (scaling)" if scaling else "")
        for client_id in list(self.clients):
            self.output_queue.put((client_id, EngineSet(self.addresses, self.scaling)))
        return {"addresses": self.addresses, "scaling": self.scaling}

    def _announced(self, message: EngineAnnounce) -> None:
        """An engine on another machine listens now: record where, and let waiting frontends in."""
        rank = message.data_parallel_rank
        known = 0 <= rank < len(self.addresses) and all(self.addresses[rank])
        if message.protocol_version != PROTOCOL_VERSION or not 0 <= rank < len(self.addresses) or known:
            logger.warning(
                "ignoring an announcement from engine %d (protocol %d)", rank, message.protocol_version
            )
            return
        self.addresses[rank] = [message.input_address, message.output_address]
        logger.info("data-parallel engine %d is at %s", rank, message.input_address)
        pending, self.pending = self.pending, []
        for client_id in pending:
            self._register(client_id, Register(PROTOCOL_VERSION, client_id))

    def _output_loop(self) -> None:
        codec = engine_codec()
        last_sent: dict[str, float] = {}
        last_turn = time.monotonic()
        # Handshakes whose frontend's output socket has not connected yet: retried on every turn, never
        # waited for in place (one frontend that never connects must not silence the others).
        waiting: dict[str, tuple[float, msgspec.Struct]] = {}
        while True:
            try:
                item = self.output_queue.get(timeout=0.01 if waiting else HEARTBEAT_INTERVAL_S / 4)
                if item is None:
                    return
                client_id, message = item
                if isinstance(message, (Ready, Rejected)):
                    waiting[client_id] = (time.monotonic() + ROUTE_RETRY_S, message)
                elif self._route(codec, client_id, message):
                    last_sent[client_id] = time.monotonic()
            except queue.Empty:
                pass
            now = time.monotonic()
            if now - last_turn > STARVED_S:  # frontends judge us dead after 10 s of silence
                logger.warning(
                    "the output thread got no turn for %.1f s (CPU or GIL starvation)", now - last_turn
                )
            last_turn = now
            for client_id, (deadline, message) in list(waiting.items()):
                sent = self._route(codec, client_id, message, wait_for_peer=now < deadline)
                if sent:
                    last_sent[client_id] = now
                if sent or now >= deadline:
                    del waiting[client_id]
            # Only frontends that have their Ready (the first thing each is sent): a heartbeat must not
            # overtake it while it waits in the output queue or in `waiting`.
            silent = [
                c
                for c in list(self.clients)
                if c in last_sent and c not in waiting and now - last_sent[c] > HEARTBEAT_INTERVAL_S
            ]
            if silent:
                stats = self.latest_stats  # made by the busy loop: never read the scheduler from here
                for silent_id in silent:
                    self._route(codec, silent_id, EngineOutputs([], time.time(), stats))
                    last_sent[silent_id] = now

    def _route(
        self, codec: Any, client_id: str, message: msgspec.Struct, wait_for_peer: bool = False
    ) -> bool:
        """Send one message; False if it could not be. EHOSTUNREACH means the frontend's output socket
        is not connected: not yet (`wait_for_peer`: a handshake, tried again later) or no more (it left:
        its requests get aborted)."""
        try:
            self.output_socket.send_multipart([client_id.encode(), *codec.encode(message)], copy=False)
            return True
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH and wait_for_peer:
                return False
            logger.warning("dropping output for frontend %s: %s", client_id, error)
            if client_id in self.clients:
                self.clients.discard(client_id)
                self.input_queue.put((client_id, _ClientGone()))
            return False

    # ---- busy loop ----

    def run(self) -> None:
        self.input_thread.start()
        self.output_thread.start()
        try:
            while not self.stop_event.is_set():
                self._maybe_log_stats()
                idle = not self.engine.can_step()  # paused or asleep with nothing in flight: idle too
                if idle:
                    self.engine.executor.check_health()  # a worker that died while idle fails us now
                if idle and os.getppid() != self.parent_pid:
                    logger.warning("the process that started the engine is gone; exiting")
                    break
                self._process_inputs(block=idle)
                if idle and self.engine.can_step():
                    self._gather_burst()
                started = time.monotonic()
                outputs = self.engine.step() if self.engine.can_step() else []
                if (took := time.monotonic() - started) > STARVED_S:
                    logger.warning("a step took %.1f s", took)
                self.latest_stats = self.engine.make_stats()
                self._send(outputs)
        except Exception as error:  # fatal: tell every frontend, then exit
            logger.exception("engine core failed")
            for client_id in list(self.clients):
                self.output_queue.put((client_id, EngineDead(f"engine core failed: {error}")))
            raise
        finally:
            self.output_queue.put(None)
            self.output_thread.join(timeout=5)
            self.stop_event.set()
            self.engine.shutdown()  # the workers leave while the input thread sees the stop
            self.input_thread.join(timeout=1)  # it polls the input socket: close that only once it is out
            self.input_socket.close()
            self.output_socket.close()
            if self.announcer is not None:
                self.announcer.close()
            self.context.term()

    def _maybe_log_stats(self) -> None:
        """Every stats_log_interval_s with activity: one line of throughput and pressure."""
        interval = self.config.stats_log_interval_s
        now = time.monotonic()
        if interval <= 0 or now - self._last_log_time < interval:
            return
        stats = self.engine.make_stats()
        last = self._last_log_stats
        elapsed = now - self._last_log_time
        self._last_log_time, self._last_log_stats = now, stats
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        generated = stats.num_generation_tokens - last.num_generation_tokens
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, waiting: %d, "
            "KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            prompt / elapsed,
            generated / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hits / queries if queries else 0.0,
        )

    def _process_inputs(self, block: bool) -> None:
        try:
            client_id, message = self.input_queue.get(timeout=0.1) if block else self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(client_id, message)
            try:
                client_id, message = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _gather_burst(self) -> None:
        """Take what arrives until a BURST_GAP_S gap, or BURST_WINDOW_S in all (see BURST_GAP_S)."""
        deadline = time.monotonic() + BURST_WINDOW_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                client_id, message = self.input_queue.get(timeout=min(BURST_GAP_S, left))
            except queue.Empty:
                return
            self._handle(client_id, message)

    def _handle(self, client_id: str, message: Any) -> None:
        if isinstance(message, AddRequest):
            try:
                self.engine.add_request(message, client_id)
            except (InvalidParameterError, ValueError) as error:
                param = error.param if isinstance(error, InvalidParameterError) else "prompt"
                message_text = error.message if isinstance(error, InvalidParameterError) else str(error)
                output = RequestOutput(
                    message.request_id,
                    [],
                    finish_reason="error",
                    error=RequestError(param, message_text, getattr(error, "code", None)),
                )
                self.output_queue.put((client_id, EngineOutputs([output], time.time())))
        elif isinstance(message, AbortRequests):
            self._send(self.engine.abort_requests(message.request_ids, message.reason))
        elif isinstance(message, UtilityCall):
            try:
                args = [decode_value(arg) for arg in message.args]
                if message.method == "set_engine_set":  # the process's own: who frontends should talk to
                    result = self._set_engine_set(*args)
                else:
                    result = self.engine.call_utility(message.method, args)
                reply = UtilityResult(message.call_id, encode_value(result))
                self._send(self.engine.take_pending_outputs())  # a pause that ended requests
                if message.method in STATE_CHANGES:
                    self._broadcast_state()
            except InvalidParameterError as error:
                reply = UtilityResult(
                    message.call_id, encode_value(None), error.message, error.param, error.code
                )
            except Exception as error:
                reply = UtilityResult(message.call_id, encode_value(None), f"{type(error).__name__}: {error}")
            if reply.error is not None and message.method in STATE_CHANGES:
                self._broadcast_state()  # a failed weight update resumed the engine
            self.output_queue.put((client_id, reply))
        elif isinstance(message, _ClientGone):
            self._drop_client(client_id)

    def _broadcast_state(self) -> None:
        """Every frontend learns a pause, resume, sleep or wake at once (their admission reads it)."""
        self.latest_stats = self.engine.make_stats()
        for client_id in list(self.clients):
            self.output_queue.put((client_id, EngineOutputs([], time.time(), self.latest_stats)))

    def _drop_client(self, client_id: str) -> None:
        """A frontend left: abort its requests so their blocks are freed."""
        self.clients.discard(client_id)
        owned = [r.request_id for r in self.engine.scheduler.requests.values() if r.client_id == client_id]
        if owned:
            logger.info("frontend %s left; aborting its %d requests", client_id, len(owned))
            self.engine.abort_requests(owned)

    def _send(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        if not outputs:
            return
        by_client: dict[str, list[RequestOutput]] = defaultdict(list)
        for request, output in outputs:
            by_client[request.client_id].append(output)
        timestamp = time.time()
        stats = self.latest_stats
        for client_id, client_outputs in by_client.items():
            self.output_queue.put((client_id, EngineOutputs(client_outputs, timestamp, stats)))

    def request_stop(self, *_: Any) -> None:
        self.stop_event.set()
        self.input_queue.put(("", _Wake()))  # an idle busy loop stops waiting for input now


class _ClientGone:
    """Internal marker queued by the output thread when a frontend cannot be reached."""


class _Wake:
    """Internal marker queued by a stop: it ends the idle busy loop's wait for input, and does nothing."""


def install_signal_handlers(proc: EngineCoreProc) -> None:
    signal.signal(signal.SIGTERM, proc.request_stop)
    signal.signal(signal.SIGINT, proc.request_stop)
