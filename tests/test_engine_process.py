"""The EngineCore process's IO threads, in-process against a fake executor: no model, no torch."""

from __future__ import annotations

import threading
import time

import zmq

from engine_core.engine_core import EngineCore
from engine_core.process import HEARTBEAT_INTERVAL_S, EngineCoreProc
from protocol.codec import engine_codec, frontend_codec
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import PROTOCOL_VERSION, EngineOutputs, Ready, Register
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
