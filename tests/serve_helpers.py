"""Helpers for tests that start real server processes: `start_serve` / `serving` (every e2e module's
`engine serve`), ports, waiting on conditions, clean stops."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def wait_healthy(
    process: subprocess.Popen[bytes], base: str, timeout_s: float = 180, verify: Any = True
) -> None:
    """Wait for `base`/health to answer 200; fail at once if the launcher exited instead. verify: httpx's
    (a CA file for an HTTPS server)."""

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy")
        return httpx.get(f"{base}/health", timeout=2, verify=verify).status_code == 200

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


def listeners_report(port: int) -> str:
    """For a failure message where fresh connections reached fewer API servers than expected: this test
    process's server processes (pid, age, state, command) and which of them listen on the port."""
    now = time.time()
    rows = []
    for process in psutil.Process(os.getpid()).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            command = " ".join(process.cmdline()[1:4])
            rows.append(f"{process.pid} {now - process.create_time():.0f}s {process.status()} {command}")
    listening = []
    with contextlib.suppress(psutil.Error):
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                listening.append(conn.pid)
    return f"processes [{'; '.join(rows)}]; listening on {port}: pids {listening}"


# The one SmolLM2 server of the modules whose flags agree (conftest.py's session fixture `smollm2_server`):
# test_serve_e2e and test_run_batch. A module needing other flags starts its own with `serving`.
SHARED_API_KEY = "test-key-123"
SHARED_MODEL_NAME = "smollm2"
SHARED_FLAGS = (
    "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", SHARED_MODEL_NAME,
    "--api-key", SHARED_API_KEY, "--api-server-count", "2",
)  # fmt: skip


@dataclass
class Served:
    """A running `engine serve`: its launcher, its HTTP base URL and, when asked for, its engine address."""

    process: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:PORT
    engine_address: str | None = None  # tcp://127.0.0.1:P, for attaching frontends and ZMQ clients


def start_serve(
    model: str | None,
    *flags: str,
    env: dict[str, str | None] | None = None,
    engine_address: bool = False,
    verify: Any = None,
    timeout_s: float = 180,
) -> Served:
    """`engine serve MODEL FLAGS` on a free loopback port, once /health answers 200 (stopped again if it
    never does). model None: none given (a frontend given `--attach ADDRESS`); env: variables set on top
    of ours (None removes one); engine_address: bind the engine on a free tcp port too; verify: the CA
    file of a server given TLS flags (its base is https). The caller stops it (`stop(served.process)`,
    or use `serving`)."""
    port = free_port()
    address = f"tcp://127.0.0.1:{free_engine_port()}" if engine_address else None
    command = [
        sys.executable,
        "-m",
        "frontend.cli",
        "serve",
        *([model] if model else []),
        "--port",
        str(port),
    ]
    command += [*flags, *(["--engine-address", address] if address is not None else [])]
    environ = {**os.environ, **(env or {})}
    environ = {name: value for name, value in environ.items() if value is not None}
    process = subprocess.Popen(command, env=environ)
    served = Served(process, f"{'https' if verify else 'http'}://127.0.0.1:{port}", address)
    try:
        wait_healthy(process, served.base, timeout_s, verify=verify or True)
    except BaseException:
        stop(process)
        raise
    return served


@contextlib.contextmanager
def serving(model: str | None, *flags: str, **options: Any) -> Iterator[Served]:
    """start_serve as a fixture's body: `with serving(model, ...) as served: yield served`."""
    served = start_serve(model, *flags, **options)
    try:
        yield served
    finally:
        stop(served.process)


@contextlib.contextmanager
def attached_frontend(served: Served, env: dict[str, str | None] | None = None) -> Iterator[Served]:
    """`engine serve --attach` to a served engine (started with engine_address=True), stopped after."""
    assert served.engine_address is not None, "start the engine with engine_address=True"
    with serving(None, "--attach", served.engine_address, env=env) as attached:
        yield attached
