"""`python -m worker.main ADDRESS PARENT_PID`: a worker process. Reads its WorkerConfig as JSON on stdin,
connects a PAIR socket to the engine, answers each SchedulerOutput with a ModelRunnerOutput.

Tensor parallel: rank 0 is the one the engine speaks to (ADDRESS); it passes every message on to the
other ranks (worker/parallel/relay.py), which start with ADDRESS "-" and answer only calls.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback
from typing import Any

import msgspec
import zmq

from protocol.codec import worker_input_codec, worker_output_codec
from protocol.config import WorkerConfig
from protocol.log_format import configure_logging
from protocol.startup import StartupPhases, exit_with_parent
from protocol.worker_messages import SchedulerOutput, WorkerCall, WorkerError, WorkerReady, WorkerShutdown

logger = logging.getLogger("engine.worker")
NO_ENGINE = "-"  # the address of a rank past 0: it hears the engine through rank 0


def main() -> None:
    # The engine owns shutdown: a Ctrl-C on the terminal reaches the whole group, and the worker
    # must keep answering until the engine tells it to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    address, parent = sys.argv[1], os.getppid()
    # SIGKILL when the engine dies, even mid-load: a worker has nothing to save
    exit_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else 0, signal.SIGKILL)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerConfig)
    configure_logging(config.log_level, config.log_format)
    phases = StartupPhases(
        "worker" if config.parallel.tensor_parallel_size == 1 else f"worker rank {config.rank}"
    )
    if address == NO_ENGINE:
        from worker.parallel.relay import RelayError

        try:
            _follow_rank_0(config, phases, parent)
        except StartupRefused:
            raise SystemExit(1) from None  # rank 0 says why
        except RelayError as error:
            logger.error("rank %d: %s", config.rank, error)
            raise SystemExit(1) from None
        return
    input_codec, output_codec = worker_input_codec(), worker_output_codec()
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(address)
    relay: Any = None
    try:
        try:
            runner, calls, relay = _load(config, phases)
        except StartupRefused as error:  # the user's settings, not a fault: one line, no traceback
            logger.error("%s", error)
            socket.send_multipart(output_codec.encode(WorkerError(str(error), refused=True)))
            raise SystemExit(1) from None
        socket.send_multipart(output_codec.encode(WorkerReady(runner.model_info())))
        phases.mark("ready")
        phases.log(logger)
        while True:
            if not socket.poll(1000):
                if os.getppid() != parent:  # the engine died without telling us
                    return
                if relay is not None:
                    relay.ping()
                continue
            frames = socket.recv_multipart()
            if relay is not None:
                relay.forward(frames)
            message = input_codec.decode(frames)
            if isinstance(message, WorkerShutdown):
                return
            if isinstance(message, WorkerCall):
                answer = calls.handle(message)
                if relay is not None:
                    from worker.parallel.relay import combine

                    answer = combine(answer, relay.gather_answers())
                socket.send_multipart(output_codec.encode(answer))
                continue
            assert isinstance(message, SchedulerOutput)
            socket.send_multipart(output_codec.encode(runner.execute_model(message)))
    except Exception:
        socket.send_multipart(output_codec.encode(WorkerError(traceback.format_exc())))
        raise
    finally:
        if relay is not None:
            relay.close()
        socket.close()
        context.term()


class StartupRefused(Exception):
    """The settings do not fit the model (e.g. heads a tensor-parallel size does not divide)."""


def _load(config: WorkerConfig, phases: StartupPhases) -> tuple[Any, Any, Any]:
    """The model runner, its calls and (tensor parallel) the relay between the ranks."""
    # The modules' objects (torch's most of them) and the model's are never garbage: no collection runs
    # over the imports and the load (the ones the imports set off took 0.19 of their 1.2 s on a Zen 4),
    # the modules' objects are frozen before the load, and one full collection after it walks what it made.
    gc.disable()
    try:
        from worker.calls import WorkerCalls
        from worker.gpu.device import DeviceError
        from worker.model_config import UnsupportedModelError
        from worker.model_runner import ModelRunner
        from worker.parallel.sharding import ShardingError

        gc.freeze()
        phases.mark("imports")
        try:
            runner = ModelRunner(config, phases)
        except (ShardingError, DeviceError, UnsupportedModelError) as error:
            raise StartupRefused(str(error)) from None
    finally:
        gc.enable()
    calls = WorkerCalls(runner)
    relay = None
    if runner.tp is not None:
        from worker.parallel.relay import Relay

        parallel = config.parallel
        relay = Relay(runner.tp.store, config.rank, parallel.tensor_parallel_size, parallel.master_addr,
                      parallel.timeout_s, runner.tp.startup_timeout_s)  # fmt: skip
        phases.mark("relay")
    gc.collect()
    gc.freeze()  # torch's and the model's objects are never garbage: collections need not walk them
    return runner, calls, relay


def _follow_rank_0(config: WorkerConfig, phases: StartupPhases, parent: int) -> None:
    """A rank past 0: run what rank 0 passes on; answer calls; step outputs stay here (rank 0 sends its)."""
    input_codec = worker_input_codec()
    runner, calls, relay = _load(config, phases)
    phases.mark("ready")
    phases.log(logger)
    try:
        while True:
            frames = relay.receive(1000)
            if frames is None:
                if os.getppid() != parent:
                    return
                continue
            message = input_codec.decode(frames)
            if isinstance(message, WorkerShutdown):
                return
            if isinstance(message, WorkerCall):
                relay.answer(calls.handle(message))
                continue
            assert isinstance(message, SchedulerOutput)
            runner.execute_model(message)
    finally:
        relay.close()
        runner.tp.destroy()


def exit_now() -> None:
    """After a clean end (the engine's shutdown, everything closed): leave without the interpreter's
    teardown, which frees torch's and the model's objects one by one (0.1-0.2 s of every stop)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_now()
