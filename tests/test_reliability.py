"""Faults and draining with real processes: an API server killed, a worker killed, a wrong engine
address, and SIGTERM with streams in flight."""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import psutil
import pytest

from protocol import temp_folders
from tests.serve_helpers import free_port, stop, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long

ENGINE_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256", "--stats-log-interval", "0"]


def start(model: str, port: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", "serve", model, "--port", str(port), *ENGINE_ARGS, *extra],
        env={**os.environ, **(env or {})},
    )


def ready(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


def engine_stats(port: int) -> dict[str, Any]:
    """The engine's stats as /load gives them; {} from an API server that has none yet (one just started)."""
    return httpx.get(f"http://127.0.0.1:{port}/load", timeout=5).json()["engine"] or {}  # type: ignore[no-any-return]


class Stream(threading.Thread):
    """A streamed completion read on a thread: its events, its final finish_reason, whether [DONE] came."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.started = threading.Event()
        self.server_index: str | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.done = False
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "prompt": "Count slowly:",
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            with httpx.stream(
                "POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=120
            ) as response:
                self.server_index = response.headers.get("x-engine-server")
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = event["error"]["message"]
                        for choice in event.get("choices", []):
                            self.started.set()
                            if choice.get("finish_reason"):
                                self.finish_reason = choice["finish_reason"]
                                self.stop_reason = choice.get("stop_reason")
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.started.set()


def stream_on(port: int, max_tokens: int) -> Stream:
    stream = Stream(port, max_tokens)
    stream.start()
    assert stream.started.wait(60), "the stream produced nothing"
    return stream


def api_servers(launcher: subprocess.Popen[bytes]) -> list[psutil.Process]:
    children = psutil.Process(launcher.pid).children()
    servers = [p for p in children if "frontend.server.main" in " ".join(p.cmdline())]
    return sorted(servers, key=lambda p: p.create_time())  # started in index order


def test_killed_api_server_then_drain_on_sigterm(smollm2_gguf: str) -> None:
    port = free_port()
    before_ipc = set(glob.glob("/tmp/engine-*"))
    # (streams long enough to outlast the drain however fast the decode: --max-model-len 4096)
    launcher = start(
        smollm2_gguf, port, "--api-server-count", "2", "--shutdown-timeout", "4", "--max-model-len", "4096"
    )
    try:
        wait_until(lambda: ready(port), 180, "the server")
        # Long streams until both API servers own one.
        streams: list[Stream] = []
        while {s.server_index for s in streams} != {"0", "1"}:
            assert len(streams) < 12, "the kernel never gave a connection to both API servers"
            streams.append(stream_on(port, 3000))
        on_victim = [s for s in streams if s.server_index == "0"]
        survivors = [s for s in streams if s.server_index == "1"]
        victim = api_servers(launcher)[0]
        victim.send_signal(signal.SIGKILL)
        for stream in on_victim:
            stream.join(30)
            assert stream.error is not None  # its client saw the connection cut
        # The engine aborted the dead frontend's requests (their blocks are freed); the others run on.
        wait_until(lambda: engine_stats(port).get("num_running") == len(survivors), 30, "the engine to abort")
        assert all(s.is_alive() and s.error is None for s in survivors)
        # The launcher starts it again on the socket it kept: the connections the kernel hashes there wait
        # for the new process instead of being refused, and fresh connections reach both servers again.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            load = f"http://127.0.0.1:{port}/load"
            answered = list(
                pool.map(lambda _: httpx.get(load, timeout=60).headers["x-engine-server"], range(16))
            )
        assert set(answered) == {"0", "1"}, answered
        assert victim.pid not in [p.pid for p in api_servers(launcher)] and len(api_servers(launcher)) == 2

        # Drain: SIGTERM with one stream that can finish in time and one that cannot.
        short = stream_on(port, 24)
        launcher.send_signal(signal.SIGTERM)
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503, 10, "readiness 503"
        )
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        short.join(30)
        assert short.finish_reason == "length" and short.done and short.error is None
        for survivor in survivors:
            survivor.join(30)
            assert survivor.finish_reason == "abort" and survivor.stop_reason == "server_shutdown"
            assert survivor.done and survivor.error is None
        assert launcher.wait(timeout=60) == 0
        assert set(glob.glob("/tmp/engine-*")) <= before_ipc, "IPC files left behind"
    finally:
        stop(launcher)


def test_overload_stall_then_killed_worker(smollm2_gguf: str) -> None:
    port = free_port()
    launcher = start(
        smollm2_gguf, port, "--max-num-seqs", "1", "--max-queued-requests", "2", "--engine-stall-timeout", "3"
    )
    try:
        wait_until(lambda: ready(port), 180, "the server")
        # Overload: one running, two waiting; the next request is refused before any tokenization.
        busy = [stream_on(port, 900)]
        busy += [Stream(port, 900) for _ in range(2)]
        for stream in busy[1:]:
            stream.start()
        wait_until(lambda: engine_stats(port).get("num_waiting") == 2, 30, "two waiting requests")
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"

        # A hung worker (stopped, not dead): no step finishes, /health reports it, and recovers after.
        tree = psutil.Process(launcher.pid).children(recursive=True)
        worker = next(p for p in tree if "worker.main" in " ".join(p.cmdline()))
        worker.suspend()
        try:

            def stalled() -> bool:
                health = httpx.get(f"http://127.0.0.1:{port}/health")
                return health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled"

            wait_until(stalled, 30, "/health to report the stall")
        finally:
            worker.resume()
        wait_until(lambda: ready(port), 30, "/health to recover")

        # A killed worker: open requests fail with an error, the launcher exits non-zero.
        worker.send_signal(signal.SIGKILL)
        for stream in busy:
            stream.join(30)
            assert stream.error is not None and stream.finish_reason is None, stream.__dict__
        assert launcher.wait(timeout=60) != 0  # so Kubernetes (or systemd) restarts it
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"orphans: {alive}"
    finally:
        stop(launcher)


def test_wrong_engine_address_is_a_clear_timeout() -> None:
    port, dead = free_port(), free_port()
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--attach", f"tcp://127.0.0.1:{dead}", "--port",
         str(port), "--engine-connect-timeout", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "no engine answered" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_a_port_in_use_stops_the_launcher_before_it_starts_an_engine(smollm2_gguf: str) -> None:
    """The HTTP port is bound first: a port in use is a one-line error, and no engine is left behind."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        started, started_at = time.monotonic(), time.time()
        run = subprocess.run(
            [sys.executable, "-m", "frontend.cli", "serve", smollm2_gguf, "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        taken.close()
    assert run.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and time.monotonic() - started < 60
    engines = [  # this run's: the session's shared server may have an engine up meanwhile
        p
        for p in psutil.process_iter(["cmdline", "create_time"])
        if "engine_core.main" in " ".join(p.info["cmdline"] or []) and p.info["create_time"] >= started_at - 1
    ]
    assert not engines, engines


@pytest.mark.parametrize("killed", ["engine_core.main", "frontend.cli"])
def test_no_process_outlives_a_parent_killed_while_the_worker_loads(smollm2_gguf: str, killed: str) -> None:
    """SIGKILL leaves no handler to clean up: the kernel's parent-death signal stops the worker (and,
    when the launcher is the one killed, the engine and the API servers) even mid-load. The folders a
    killed launcher made stay, named for it, and the next start's sweep removes them."""
    port = free_port()
    folder = tempfile.mkdtemp(prefix="r-")  # (not tmp_path: an ipc path inside holds 107 bytes at most)
    launcher = start(smollm2_gguf, port, env={"TMPDIR": folder})
    try:

        def worker_started() -> list[psutil.Process] | None:
            tree = psutil.Process(launcher.pid).children(recursive=True)
            return tree if any("worker.main" in " ".join(p.cmdline()) for p in tree) else None

        tree = wait_until(worker_started, 120, "the worker process", interval_s=0.01)  # it loads for seconds
        target = psutil.Process(launcher.pid)
        if killed == "engine_core.main":
            target = next(p for p in tree if "engine_core.main" in " ".join(p.cmdline()))
        target.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert not alive, f"orphans: {alive}"
        code = launcher.wait(timeout=60)
        assert code != 0
    finally:
        stop(launcher)
    left = sorted(os.listdir(folder))
    if killed == "frontend.cli":  # its engine's folder and refusal file at least
        assert any(name.startswith(temp_folders.prefix("run", launcher.pid))
                   for name in left), left  # fmt: skip
    temp_folders.sweep(folder)
    after = os.listdir(folder)
    shutil.rmtree(folder)
    assert not after, f"left {left}, then {after} after the sweep"
