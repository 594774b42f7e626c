"""The in-process executor: the model runs inside the caller's process (tests, IPC-cost measurements)."""

from __future__ import annotations

from protocol.config import WorkerConfig
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner


class InprocExecutor:
    def __init__(self, config: WorkerConfig) -> None:
        self.runner = ModelRunner(config)
        self.model_info = self.runner.model_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
