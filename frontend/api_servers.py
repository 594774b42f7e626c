"""The launcher's API server processes: started on their listening sockets, started again when one dies
once the deployment has served, stopped (each draining) at the end."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import msgspec

from frontend.server.config import ServerConfig
from protocol.startup import parent_pid_arg

logger = logging.getLogger("engine.launcher")


@dataclass
class ApiServer:
    """One API server's place: its config, the launcher's copy of its listening socket (None: a gRPC
    server, which binds its own port), its process now, and when it was started again."""

    config: ServerConfig
    sock: socket.socket | None
    process: subprocess.Popen[bytes]
    restarts: list[float] = field(default_factory=list)  # monotonic times
    given_up: bool = False


class ApiServerPool:
    """An API server that died (a non-zero exit: killed, crashed) is started again on the same socket, which
    the launcher keeps open meanwhile: the kernel goes on queueing the connections it hashes to that socket,
    and the new process accepts them. Only after some API server has said it is ready (a start that fails
    everywhere, a bad flag or a TLS file, is the deployment's error, not a crash), and at most RESTART_LIMIT
    times in RESTART_WINDOW_S each. One that exited 0 was drained on purpose (its own SIGTERM) and stays
    down. One not started again has its socket closed, so that the kernel hands the others its connections."""

    RESTART_LIMIT = 3
    RESTART_WINDOW_S = 60.0

    def __init__(self, state_dir: str) -> None:
        self.servers: list[ApiServer] = []
        self.state_dir = state_dir  # where each API server leaves its ready file

    def start(self, sock: socket.socket | None, config: ServerConfig) -> None:
        ready = os.path.join(self.state_dir, f"ready-{config.server_index}")
        config = msgspec.structs.replace(config, ready_file=ready)
        self.servers.append(ApiServer(config, sock, self._spawn(sock, config)))

    @staticmethod
    def _spawn(sock: socket.socket | None, config: ServerConfig) -> subprocess.Popen[bytes]:
        fd = sock.fileno() if sock is not None else -1
        process = subprocess.Popen(
            [sys.executable, "-m", "frontend.server.main", str(fd), parent_pid_arg()],
            stdin=subprocess.PIPE,
            pass_fds=(fd,) if sock is not None else (),
        )
        assert process.stdin is not None
        process.stdin.write(msgspec.json.encode(config))
        process.stdin.close()
        return process

    def all_exited(self) -> bool:
        return bool(self.servers) and all(s.process.poll() is not None for s in self.servers)

    def signal_all(self, sig: int) -> None:
        for server in self.servers:
            if server.process.poll() is None:
                server.process.send_signal(sig)

    def look(self) -> None:
        """Start again each API server that died since the last look, where the rules above allow."""
        for index, server in enumerate(self.servers):
            code = server.process.poll()
            if code is None or server.given_up:
                continue
            served = any(os.path.exists(s.config.ready_file) for s in self.servers)
            now = time.monotonic()
            server.restarts = [t for t in server.restarts if now - t < self.RESTART_WINDOW_S]
            _forget_metrics(server.process.pid)
            why = self._left_down(code, served, len(server.restarts))
            if why is not None:
                logger.error("API server %d exited (code %s) %s; the others serve on", index, code, why)
                server.given_up = True
                if server.sock is not None and sum(s.sock is server.sock for s in self.servers) == 1:
                    server.sock.close()  # the kernel stops hashing connections to it
                continue
            logger.error("API server %d exited (code %s); starting it again", index, code)
            server.restarts.append(now)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(server.config.ready_file)
            server.process = self._spawn(server.sock, server.config)

    def _left_down(self, code: int, served: bool, recent_restarts: int) -> str | None:
        """Why an API server that exited with this code is not started again; None: it is."""
        if code == 0:
            return "drained"
        if not served:
            return "before any API server was ready"
        if recent_restarts >= self.RESTART_LIMIT:
            return f"{recent_restarts} times in {self.RESTART_WINDOW_S:.0f} s"
        return None

    def stop(self, timeout_s: float) -> None:
        """SIGTERM each (it drains), kill one still there after timeout_s, then close the sockets."""
        self.signal_all(signal.SIGTERM)
        for sock in {id(s.sock): s.sock for s in self.servers if s.sock is not None}.values():
            sock.close()  # connections that come now are refused instead of waiting in a backlog
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            try:
                server.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()


def _forget_metrics(pid: int) -> None:
    """A dead process's live-summed gauges (open WebSockets) leave the sum (prometheus_client's rule)."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, folder)
