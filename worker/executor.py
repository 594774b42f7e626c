"""The in-process executor: the model runs inside the caller's process (tests, IPC-cost measurements)."""

from __future__ import annotations

from collections import deque

from protocol.config import WorkerConfig
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner


class InprocExecutor:
    """Runs a submitted step when its output is collected: the order a worker process keeps."""

    def __init__(self, config: WorkerConfig) -> None:
        self.runner = ModelRunner(config)
        self.model_info = self.runner.model_info()
        self.submitted: deque[SchedulerOutput] = deque()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.submitted.append(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        return self.runner.execute_model(self.submitted.popleft())

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
