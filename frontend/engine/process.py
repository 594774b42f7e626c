"""Starting and stopping an EngineCore process (`python -m engine_core.main`) from a frontend."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec

from protocol.config import EngineConfig
from protocol.startup import parent_pid_arg


class EngineProcess:
    """Owns the engine process; the engine in turn owns its workers."""

    def __init__(self, config: EngineConfig) -> None:
        self._ipc_dir: str | None = None
        if not config.input_address or not config.output_address:
            self._ipc_dir = tempfile.mkdtemp(prefix="engine-")
            config.input_address = config.input_address or f"ipc://{self._ipc_dir}/input"
            config.output_address = config.output_address or f"ipc://{self._ipc_dir}/output"
        self.config = config
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine_core.main", parent_pid_arg()], stdin=subprocess.PIPE
        )
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(config))
        self.process.stdin.close()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    @property
    def pid(self) -> int:
        return self.process.pid
