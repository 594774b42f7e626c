"""`python -m worker.main ADDRESS PARENT_PID`: a worker process. Reads its WorkerConfig as JSON on stdin,
connects a PAIR socket to the engine, answers each SchedulerOutput with a ModelRunnerOutput."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from protocol.codec import worker_input_codec, worker_output_codec
from protocol.config import WorkerConfig
from protocol.log_format import configure_logging
from protocol.startup import StartupPhases, exit_with_parent
from protocol.worker_messages import SchedulerOutput, WorkerCall, WorkerError, WorkerReady, WorkerShutdown

logger = logging.getLogger("engine.worker")


def main() -> None:
    # The engine owns shutdown: a Ctrl-C on the terminal reaches the whole group, and the worker
    # must keep answering until the engine tells it to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    phases = StartupPhases("worker")
    address, parent = sys.argv[1], os.getppid()
    # SIGKILL when the engine dies, even mid-load: a worker has nothing to save
    exit_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else 0, signal.SIGKILL)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerConfig)
    configure_logging(config.log_level, config.log_format)
    input_codec, output_codec = worker_input_codec(), worker_output_codec()
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(address)
    try:
        from worker.calls import WorkerCalls
        from worker.model_runner import ModelRunner

        phases.mark("imports")
        runner = ModelRunner(config, phases)
        calls = WorkerCalls(runner)
        gc.collect()
        gc.freeze()  # torch's and the model's objects are never garbage: collections need not walk them
        socket.send_multipart(output_codec.encode(WorkerReady(runner.model_info())))
        phases.mark("ready")
        phases.log(logger)
        while True:
            if not socket.poll(1000):
                if os.getppid() != parent:  # the engine died without telling us
                    return
                continue
            message = input_codec.decode(socket.recv_multipart())
            if isinstance(message, WorkerShutdown):
                return
            if isinstance(message, WorkerCall):
                socket.send_multipart(output_codec.encode(calls.handle(message)))
                continue
            assert isinstance(message, SchedulerOutput)
            socket.send_multipart(output_codec.encode(runner.execute_model(message)))
    except Exception:
        socket.send_multipart(output_codec.encode(WorkerError(traceback.format_exc())))
        raise
    finally:
        socket.close()
        context.term()


if __name__ == "__main__":
    main()
