"""The in-process executor: the model runs inside the caller's process (tests, IPC-cost measurements)."""

from __future__ import annotations

from collections import deque

from protocol.config import WorkerConfig
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput, WorkerCall, WorkerCallResult
from worker.calls import WorkerCalls
from worker.model_runner import ModelRunner


class InprocExecutor:
    """Runs a submitted step when its output is collected: the order a worker process keeps."""

    def __init__(self, config: WorkerConfig) -> None:
        self.runner = ModelRunner(config)
        self.model_info = self.runner.model_info()
        self.calls = WorkerCalls(self.runner)
        self.submitted: deque[SchedulerOutput] = deque()
        self.ran: deque[ModelRunnerOutput] = deque()  # steps a call ran ahead of their collect

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.submitted.append(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        if self.ran:
            return self.ran.popleft()
        return self.runner.execute_model(self.submitted.popleft())

    def call(self, call: WorkerCall, timeout_s: float | None = None) -> WorkerCallResult:
        """Run after the steps submitted before it, as a worker process does."""
        while self.submitted:
            self.ran.append(self.runner.execute_model(self.submitted.popleft()))
        return self.calls.handle(call)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
