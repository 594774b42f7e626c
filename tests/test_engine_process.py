"""The EngineCore process's IO threads, in-process against a fake executor: no model, no torch."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import zmq

from engine_core.engine_core import EngineCore
from engine_core.process import BURST_WINDOW_S, HEARTBEAT_INTERVAL_S, EngineCoreProc
from protocol.codec import engine_codec, frontend_codec
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import PROTOCOL_VERSION, AbortRequests, AddRequest, EngineOutputs, Ready, Register
from protocol.sampling import SamplingParams
from tests.fake_executor import FakeExecutor


def test_a_frontend_that_never_connects_its_output_does_not_silence_the_others(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Ready waits (up to ROUTE_RETRY_S) for its frontend's output socket; meanwhile every other
    frontend still gets its own Ready and a heartbeat each second."""
    config = EngineConfig(
        worker=WorkerConfig(model="fake"),
        input_address=f"ipc://{tmp_path}/in",
        output_address=f"ipc://{tmp_path}/out",
    )
    proc = EngineCoreProc(config, EngineCore(config, FakeExecutor()))
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    context = zmq.Context()
    sockets = []

    def dealer(identity: str, address: str) -> zmq.Socket:  # type: ignore[type-arg]
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sockets.append(sock)
        return sock

    codec, decoder = frontend_codec(), engine_codec()
    try:
        # Registers through its input socket only: its Ready has nowhere to go.
        dealer("stuck", config.input_address).send_multipart(
            codec.encode(Register(PROTOCOL_VERSION, "stuck"))
        )
        output = dealer("good", config.output_address)
        dealer("good", config.input_address).send_multipart(codec.encode(Register(PROTOCOL_VERSION, "good")))
        started = time.monotonic()
        assert output.poll(2000), "no Ready within 2 s"
        assert isinstance(decoder.decode(output.recv_multipart()), Ready)
        arrivals = []
        while time.monotonic() - started < 4.0:
            assert output.poll(int(3000 * HEARTBEAT_INTERVAL_S)), "no heartbeat for 3 intervals"
            assert isinstance(decoder.decode(output.recv_multipart()), EngineOutputs)
            arrivals.append(time.monotonic())
        assert len(arrivals) >= 2
    finally:
        proc.request_stop()
        thread.join(timeout=10)
        for sock in sockets:
            sock.close()
        context.term()
    assert not thread.is_alive()


class _Arrivals(queue.Queue):  # type: ignore[type-arg]
    """An input queue whose next message arrives each time the busy loop waits for one, `count` times
    (forever when None): a burst reaching the engine a few ms apart, without sleeping in the test."""

    def __init__(self, make: Any, count: int | None) -> None:
        super().__init__()
        self.make, self.count, self.served = make, count, 0

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.count is None or self.served < self.count:
            self.served += 1
            return self.make(self.served)
        raise queue.Empty


def test_an_idle_engine_takes_a_burst_into_its_first_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Woken from idle by one request, the busy loop keeps taking requests while they keep coming (each
    within BURST_GAP_S), so the burst is prefilled in one step; an endless stream stops it after
    BURST_WINDOW_S."""
    config = EngineConfig(
        worker=WorkerConfig(model="fake"),
        input_address=f"ipc://{tmp_path}/in",
        output_address=f"ipc://{tmp_path}/out",
        async_scheduling=False,  # one step submitted and collected at once: its batch is in executor.steps
    )
    executor = FakeExecutor()
    proc = EngineCoreProc(config, EngineCore(config, executor))
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def add(i: int) -> tuple[str, AddRequest]:
        return "client", AddRequest(
            request_id=str(i), prompt_token_ids=[5, 6, 7], sampling_params=params, arrival_time=0
        )

    try:
        proc.engine.add_request(add(0)[1], "client")  # the request that woke the loop
        proc.input_queue = _Arrivals(add, 5)
        proc._gather_burst()
        proc.engine.step()
        assert sorted(new.request_id for new in executor.steps[0].new_requests) == [
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
        ]

        proc.input_queue = _Arrivals(lambda i: ("client", AbortRequests([f"gone-{i}"])), None)
        started = time.monotonic()
        proc._gather_burst()
        assert time.monotonic() - started < BURST_WINDOW_S + 1.0, "the window did not end an endless stream"
        assert proc.input_queue.served > 1
    finally:
        proc.input_socket.close()
        proc.output_socket.close()
        proc.context.term()
