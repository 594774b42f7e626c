"""Startup phases: each process times its own and logs them in one line when it is ready.

`engine serve` logs one such line per process (launcher, engine, worker, API servers), so a slow start
names its slow phase: `worker startup 3.12 s: imports 2.31, kernels 0.20, weights 0.41, ...`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time


def process_age_s() -> float:
    """Seconds since this process started (the interpreter's own start and imports included); 0.0
    where /proc is absent."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except OSError:
        return 0.0
    started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
    return max(uptime_s - started_s, 0.0)


class StartupPhases:
    """Times consecutive phases from the process's start on; `mark(name)` ends the phase called name (the
    first one takes in the interpreter's start and the imports before construction)."""

    def __init__(self, process: str) -> None:
        self.process = process
        self.started = time.monotonic() - process_age_s()
        self._last = self.started
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> float:
        now = time.monotonic()
        elapsed_s = now - self._last
        self.phases.append((name, elapsed_s))
        self._last = now
        return elapsed_s

    @property
    def total_s(self) -> float:
        return self._last - self.started

    def summary(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases)
        return f"{self.process} startup {self.total_s:.2f} s: {parts}"

    def log(self, logger: logging.Logger) -> None:
        logger.info("%s", self.summary())


PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
# the folder an engine's spawner made for it and removes at the end, even after a SIGKILL: the engine's
# workers' sockets go there (without it, a temporary folder of their own)
RUN_DIR_ENV = "ENGINE_RUN_DIR"


def parent_pid_arg() -> str:
    """What a spawner passes its child for exit_with_parent: its pid, or "0" from a thread other than the
    main one (the kernel's parent-death signal fires when the spawning *thread* exits)."""
    return str(os.getpid()) if threading.current_thread() is threading.main_thread() else "0"


def exit_with_parent(parent_pid: int, sig: int) -> None:
    """Have the kernel send sig to this process when its parent exits (Linux), and exit now if the parent
    is gone already: a child must never outlive the process that started it, even one killed with
    SIGKILL while the child was still loading. Elsewhere, and for parent_pid 0 (parent_pid_arg), the
    child's own loops watch os.getppid()."""
    if parent_pid == 0:
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
