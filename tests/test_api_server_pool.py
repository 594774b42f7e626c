"""The launcher's rules for an API server that exits (frontend/api_servers.py), on stand-in processes that
exit with a chosen code: started again on its socket after a crash once the deployment has served, at most
3 times a minute; left down after a drain (exit 0), or a crash before any server was ready, its socket then
closed. The real restart of a killed API server is tests/test_reliability.py's."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from frontend.api_servers import ApiServer, ApiServerPool
from frontend.server.config import ServerConfig


class Pool(ApiServerPool):
    """The pool, its processes stand-ins: each start runs a process that exits with the next code given."""

    def __init__(self, state_dir: str, codes: list[int]) -> None:
        super().__init__(state_dir)
        self.codes = codes
        self.spawned = 0

    def _spawn(self, sock: socket.socket | None, config: ServerConfig) -> subprocess.Popen[bytes]:
        self.spawned += 1
        process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({self.codes.pop(0)})"])
        process.wait(30)
        return process


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    yield listening
    listening.close()


def start(pool: Pool, sock: socket.socket, index: int = 0) -> ApiServer:
    pool.start(sock, ServerConfig(model="m", input_address="", output_address="", server_index=index))
    return pool.servers[-1]


def test_a_crash_after_the_deployment_served_is_started_again_three_times_a_minute(
    tmp_path: pathlib.Path, sock: socket.socket
) -> None:
    pool = Pool(str(tmp_path), [1, 1, 1, 1, 1])
    server = start(pool, sock)
    pathlib.Path(server.config.ready_file).touch()  # it had served
    for restarts in (1, 2, 3):
        pool.look()
        assert pool.spawned == 1 + restarts and not server.given_up
        assert not pathlib.Path(server.config.ready_file).exists()  # the new process leaves its own
        pathlib.Path(server.config.ready_file).touch()
    pool.look()  # a fourth crash within the minute: left down, its socket closed
    assert pool.spawned == 4 and server.given_up and sock.fileno() == -1
    assert pool.all_exited()


def test_a_drained_server_stays_down_and_its_socket_closes(
    tmp_path: pathlib.Path, sock: socket.socket
) -> None:
    pool = Pool(str(tmp_path), [0])
    server = start(pool, sock)
    pathlib.Path(server.config.ready_file).touch()
    pool.look()
    assert pool.spawned == 1 and server.given_up and sock.fileno() == -1


def test_a_crash_before_any_server_was_ready_is_the_deployments_error(
    tmp_path: pathlib.Path, sock: socket.socket
) -> None:
    pool = Pool(str(tmp_path), [2, 2])
    first, second = start(pool, sock, 0), start(pool, sock, 1)  # one socket shared (a Unix socket's way)
    pool.look()
    assert pool.spawned == 2 and first.given_up and second.given_up and pool.all_exited()
    assert sock.fileno() != -1  # shared: the launcher closes it at the end, not here
