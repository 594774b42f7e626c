"""Executors run SchedulerOutputs on workers. The multiprocess one starts one worker process per device.

The engine never imports torch: workers are separate processes spoken to over ZMQ with msgspec, and
the in-process executor (worker/executor.py) is handed in by whoever builds the EngineCore.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from typing import Protocol

import msgspec
import zmq

from protocol.codec import worker_input_codec, worker_output_codec
from protocol.config import WorkerConfig
from protocol.messages import ModelInfo
from protocol.startup import parent_pid_arg
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


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported an error."""


class CallTimeoutError(TimeoutError):
    """A worker call took longer than its caller would wait (the worker is alive and answers later)."""


class MultiprocExecutor:
    """One worker process (rank 0). A step submitted while the worker runs another waits in its socket,
    so the worker starts it as soon as it has sent the other's output."""

    POLL_INTERVAL_MS = 1000

    def __init__(self, config: WorkerConfig, load_timeout_s: float = 600.0) -> None:
        self._early: deque[ModelRunnerOutput] = deque()  # step outputs a call read ahead of collect
        self._abandoned = 0  # calls that timed out: their answers are still to come, and are dropped
        self._input_codec = worker_input_codec()
        self._output_codec = worker_output_codec()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._ipc_dir = tempfile.mkdtemp(prefix="engine-worker-")
        address = f"ipc://{self._ipc_dir}/{uuid.uuid4().hex[:8]}"
        self._socket.bind(address)
        # NOTE: a fresh interpreter (not fork) so that torch's threads start clean in the worker.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "worker.main", address, parent_pid_arg()],
            stdin=subprocess.PIPE,
            env=os.environ.copy(),
        )
        assert self._process.stdin is not None
        self._process.stdin.write(msgspec.json.encode(config))
        self._process.stdin.close()
        message = self._receive(timeout_s=load_timeout_s)
        if not isinstance(message, WorkerReady):
            raise WorkerDiedError(f"worker sent {type(message).__name__} instead of WorkerReady")
        self.model_info = message.model_info

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
            raise WorkerDiedError(f"worker failed: {message.message}")
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
        code = self._process.poll()
        if code is not None:
            raise WorkerDiedError(f"worker process exited with code {code}")

    def shutdown(self) -> None:
        if self._process.poll() is None:
            try:
                self._socket.send_multipart(self._input_codec.encode(WorkerShutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._socket.close()
        self._context.term()
        try:
            for name in os.listdir(self._ipc_dir):
                os.unlink(os.path.join(self._ipc_dir, name))
            os.rmdir(self._ipc_dir)
        except OSError:
            pass
