"""An API server's start: the tokenizer loads on a thread that yields the processors to the engine's worker
(frontend/server/main.py in_yielding_thread), which is what /health waits for; its result and its errors
reach the awaiting task."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from frontend.server.main import TOKENIZER_NICE, in_yielding_thread


def test_the_tokenizer_thread_yields_and_hands_back_its_result_and_errors() -> None:
    def niceness() -> tuple[int, bool]:
        thread = threading.current_thread()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), thread is threading.main_thread()

    def fails() -> None:
        raise OSError("no tokenizer here")

    async def run() -> tuple[int, bool]:
        result = await in_yielding_thread(niceness)
        with pytest.raises(OSError, match="no tokenizer here"):
            await in_yielding_thread(fails)
        return result  # type: ignore[no-any-return]

    before = os.getpriority(os.PRIO_PROCESS, 0)
    nice, on_main = asyncio.run(run())
    assert nice == min(before + TOKENIZER_NICE, 19) and not on_main
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the process's own (its main thread's) is untouched


def test_the_engine_listens_for_its_frontends_before_its_worker_has_loaded(smollm2_gguf: str) -> None:
    """The engine binds its frontends' sockets before it starts its worker: when the worker process
    appears (its load takes a second more), the API servers can already connect, so their Register is
    waiting when the engine is ready (ZMQ retried a connect to an address nobody listened on every 100 ms,
    up to 0.1 s of every start)."""
    import subprocess
    import sys

    import psutil

    from tests.serve_helpers import free_port, stop, wait_healthy, wait_until

    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", "serve", smollm2_gguf, "--port", str(port)]
    )
    try:

        def loading_worker() -> tuple[psutil.Process, psutil.Process] | None:
            tree = psutil.Process(launcher.pid).children(recursive=True)
            engine = next((p for p in tree if "engine_core.main" in " ".join(p.cmdline())), None)
            worker = next((p for p in tree if "worker.main" in " ".join(p.cmdline())), None)
            return (engine, worker) if engine is not None and worker is not None else None

        engine, worker = wait_until(loading_worker, 120, "the worker process", interval_s=0.01)
        run_dir = engine.environ()["ENGINE_RUN_DIR"]
        listening = sorted(name for name in os.listdir(run_dir) if name in ("input", "output"))
        assert listening == ["input", "output"], os.listdir(run_dir)
        wait_healthy(launcher, f"http://127.0.0.1:{port}", 120)
    finally:
        stop(launcher)
