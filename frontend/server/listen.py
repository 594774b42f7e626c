"""The API servers' listening sockets, bound by the launcher before the engine starts (a port in use stops
it first): one per API server on one port, or one Unix socket they share (--uds)."""

from __future__ import annotations

import os
import socket
import stat


def bind_unix_socket(path: str) -> socket.socket:
    """--uds: the API servers share a listening Unix socket at path (a stale one from a dead server is
    replaced; anything else there is an error)."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise SystemExit(f"engine: --uds {path}: a file that is not a socket is there")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as error:
        sock.close()
        raise SystemExit(f"engine: cannot listen on {path}: {error.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_http_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise SystemExit(f"engine: cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def bind_http_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per API server, all on host:port in one SO_REUSEPORT group: the kernel spreads
    new connections over them by their addresses' hash. (One shared socket would hand nearly every
    connection to the server that went idle last, while the others wait.) The port is first taken alone,
    so an engine already serving on it, whose group would take us in, stops us as any other user does."""
    if count == 1 or not hasattr(socket, "SO_REUSEPORT"):
        return [bind_http_socket(host, port)] * count
    probe = bind_http_socket(host, port)
    port = probe.getsockname()[1]  # port 0: the one the kernel chose
    probe.close()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    group: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        group.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
            sock.listen(2048)
        except OSError as error:
            for taken in group:
                taken.close()
            raise SystemExit(f"engine: cannot listen on {host}:{port}: {error.strerror}") from None
        sock.set_inheritable(True)
    return group
