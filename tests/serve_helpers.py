"""Helpers for tests that start real server processes: ports, waiting on conditions, clean stops."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time

import httpx
import psutil


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()  # ports this process has already given a test: never handed out twice


def _free_ports(count: int) -> int:
    """The first of `count` adjacent ports, all free now, chosen below the kernel's ephemeral range: a port
    that `bind(("", 0))` hands out can be handed out again, or taken by an outgoing connection, between the
    test's check and the server's bind (an engine's P + 1 taken that way made it exit with "Address already
    in use"). Below the range only another test's explicit bind can take it: the ports given out here are
    remembered, and the choice is random so that separate test processes rarely meet."""
    low = 20000
    high = min(_ephemeral_start(), 32768) - count
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(low, high)
        ports = range(first, first + count)
        if _handed_out.intersection(ports):
            continue
        sockets = [socket.socket() for _ in ports]
        try:
            for port, sock in zip(ports, sockets, strict=True):
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        _handed_out.update(ports)
        return first
    raise RuntimeError(f"no {count} adjacent free ports in [{low}, {high})")


def free_port() -> int:
    return _free_ports(1)


def free_engine_port() -> int:
    """A port P for `--engine-address tcp://127.0.0.1:P`: the engine binds P and P + 1, so both must be free."""
    return _free_ports(2)


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.2):  # type: ignore[no-untyped-def]
    """The condition's first truthy value, checked every interval_s; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except (httpx.HTTPError, OSError, psutil.Error):
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_healthy(process: subprocess.Popen[bytes], base: str, timeout_s: float = 180) -> None:
    """Wait for `base`/health to answer 200; fail at once if the launcher exited instead."""

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy")
        return httpx.get(f"{base}/health", timeout=2).status_code == 200

    wait_until(healthy, timeout_s, "the server to be healthy")


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
