"""Executors run SchedulerOutputs on workers. The multiprocess one starts one worker process per device.

The engine never imports torch: workers are separate processes spoken to over ZMQ with msgspec, and
the in-process executor (worker/executor.py) is handed in by whoever builds the EngineCore.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from typing import Any, Protocol

import msgspec
import zmq

from protocol import temp_folders
from protocol.codec import worker_input_codec, worker_output_codec
from protocol.config import WorkerConfig
from protocol.messages import ModelInfo
from protocol.startup import RUN_DIR_ENV, parent_pid_arg
from protocol.worker_messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerCall,
    WorkerCallResult,
    WorkerError,
    WorkerReady,
    WorkerShutdown,
)


class Executor(Protocol):
    """Steps go in with submit and their outputs come back with collect, in the order submitted; the
    engine keeps at most two in flight (engine_core/engine_core.py)."""

    model_info: ModelInfo

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput: ...

    def call(self, call: WorkerCall, timeout_s: float | None = None) -> WorkerCallResult:
        """Run a worker method after the steps submitted so far (their outputs stay for collect)."""
        ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def start_worker(config: WorkerConfig, address: str) -> subprocess.Popen[bytes]:
    """A worker process for one rank; address: the engine's socket (rank 0), or "-" (the others)."""
    # NOTE: a fresh interpreter (not fork) so that torch's threads start clean in the worker.
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.main", address, parent_pid_arg()],
        stdin=subprocess.PIPE,
        env=os.environ.copy(),
    )
    assert process.stdin is not None
    process.stdin.write(msgspec.json.encode(config))
    process.stdin.close()
    return process


def free_port(host: str) -> int:
    """A TCP port free on host now (the ranks' store binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class StartupRefusedError(RuntimeError):
    """The worker refused the user's settings or model at load (its one-line reason): not a fault."""


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported an error."""


class CallTimeoutError(TimeoutError):
    """A worker call took longer than its caller would wait (the worker is alive and answers later)."""


class MultiprocExecutor:
    """One worker process per local rank; the engine speaks to rank 0, which passes each message on to the
    other ranks (worker/parallel/relay.py) and answers for the group. A step submitted while the worker runs
    another waits in its socket, so the worker starts it as soon as it has sent the other's output."""

    POLL_INTERVAL_MS = 1000

    def __init__(self, config: WorkerConfig, load_timeout_s: float = 600.0) -> None:
        self._early: deque[ModelRunnerOutput] = deque()  # step outputs a call read ahead of collect
        self._abandoned = 0  # calls that timed out: their answers are still to come, and are dropped
        self._input_codec = worker_input_codec()
        self._output_codec = worker_output_codec()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._ipc_dir: str | None = None
        address = self._bind()
        self._processes: list[Any] = self._start_ranks(config, address)  # poll(), wait(timeout), kill()
        self._process = self._processes[0]
        message = self._receive(timeout_s=load_timeout_s)
        if not isinstance(message, WorkerReady):
            raise WorkerDiedError(f"worker sent {type(message).__name__} instead of WorkerReady")
        self.model_info = message.model_info

    def _bind(self) -> str:
        """The engine's end of rank 0's socket: an ipc path (the workers run on this machine)."""
        run_dir = os.environ.get(RUN_DIR_ENV)  # (short names inside it: an ipc path holds 107 bytes)
        self._ipc_dir = (
            tempfile.mkdtemp(prefix="w-", dir=run_dir) if run_dir else temp_folders.folder("worker")
        )
        address = f"ipc://{self._ipc_dir}/{uuid.uuid4().hex[:8]}"
        self._socket.bind(address)
        return address

    def _start_ranks(self, config: WorkerConfig, address: str) -> list[Any]:
        parallel = config.parallel
        if parallel.tensor_parallel_size > 1 and parallel.master_port == 0:
            parallel = msgspec.structs.replace(parallel, master_port=free_port(parallel.master_addr))
        # rank 0 first: the others' addresses are in its store
        return [
            start_worker(
                msgspec.structs.replace(config, parallel=parallel, rank=rank),
                address if rank == 0 else "-",
            )
            for rank in parallel.local_ranks
        ]

    def _receive(
        self, timeout_s: float | None = None, timeout_error: type[Exception] | None = None
    ) -> object:
        waited_ms = 0
        interval = (
            self.POLL_INTERVAL_MS
            if timeout_s is None
            else max(1, min(self.POLL_INTERVAL_MS, int(timeout_s * 1000)))
        )
        while not self._socket.poll(interval):
            waited_ms += interval
            self.check_health()
            if timeout_s is not None and waited_ms >= timeout_s * 1000:
                raise (timeout_error or WorkerDiedError)(f"worker did not answer within {timeout_s:.1f} s")
        message = self._output_codec.decode(self._socket.recv_multipart(copy=False))
        if isinstance(message, WorkerError):
            if message.refused:
                raise StartupRefusedError(message.message)
            # the worker has logged its traceback; what reaches clients and the engine's log is its last line
            lines = [line for line in message.message.strip().splitlines() if line.strip()]
            raise WorkerDiedError(f"worker failed: {lines[-1] if lines else 'no reason given'}")
        return message

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._socket.send_multipart(self._input_codec.encode(scheduler_output), copy=False)

    def collect(self) -> ModelRunnerOutput:
        if self._early:
            return self._early.popleft()
        while True:
            message = self._receive()
            if isinstance(message, WorkerCallResult) and self._abandoned:
                self._abandoned -= 1  # the late answer of a call that timed out
                continue
            assert isinstance(message, ModelRunnerOutput)
            return message

    def call(self, call: WorkerCall, timeout_s: float | None = None) -> WorkerCallResult:
        """timeout_s: CallTimeoutError past it; the worker's late answer is then dropped when it comes, so
        the answers that follow stay matched to their calls."""
        self._socket.send_multipart(self._input_codec.encode(call), copy=False)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                message = self._receive(left, CallTimeoutError)
            except CallTimeoutError:
                self._abandoned += 1
                raise
            if isinstance(message, WorkerCallResult):
                if self._abandoned:
                    self._abandoned -= 1  # an earlier call's late answer: ours comes after it
                    continue
                return message
            assert isinstance(message, ModelRunnerOutput)
            self._early.append(message)  # a step submitted before the call: collect returns it next

    def check_health(self) -> None:
        for rank, process in enumerate(self._processes):
            code = process.poll()
            if code is not None:
                who = "worker" if len(self._processes) == 1 else f"worker rank {rank}"
                raise WorkerDiedError(f"{who} process exited with code {code}")

    def shutdown(self) -> None:
        """Rank 0 passes the shutdown on and gets 5 s to leave (a step it is in finishes first); the other ranks, which leave as soon as
        they hear it, 3 s after that (one stuck in a collective whose peer died, or stopped, never will);
        then they are killed."""
        if self._process.poll() is None:
            try:
                self._socket.send_multipart(self._input_codec.encode(WorkerShutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for index, process in enumerate(self._processes):
            if index == 1:
                deadline = time.monotonic() + 3
            try:
                process.wait(timeout=5 if index == 0 else max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._socket.close()
        self._context.term()
        if self._ipc_dir is None:
            return
        try:
            for name in os.listdir(self._ipc_dir):
                os.unlink(os.path.join(self._ipc_dir, name))
            os.rmdir(self._ipc_dir)
        except OSError:
            pass
