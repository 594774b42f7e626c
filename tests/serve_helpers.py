"""Helpers for tests that start real server processes: ports, waiting on conditions, clean stops."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_engine_port() -> int:
    """A port P for `--engine-address tcp://127.0.0.1:P`: the engine binds P and P + 1, so both must be free
    (a P + 1 held by some other socket made a headless engine exit with "Address already in use")."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def wait_until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM a launcher; fail if any process it started outlives it."""
    tree = psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    _, alive = psutil.wait_procs(tree, timeout=30)
    for leftover in alive:
        leftover.kill()
    assert not alive, f"processes outlived their launcher: {alive}"
