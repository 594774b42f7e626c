"""A loopback HTTP server of test images, started and stopped by the test that uses it: fixed bodies by path,
a redirect, a 404, and a path that answers too slowly."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def image_server(files: dict[str, tuple[str, bytes]], slow_s: float = 3.0) -> Iterator[str]:
    """files: path -> (content type, body). Also /redirect/PATH (302 to PATH, or to PATH as a whole URL when it
    is one), /slow (answers after slow_s)
    and 404 for anything else. Yields the base URL."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path
            if path.startswith("/redirect/"):
                self.send_response(302)
                target = path.removeprefix("/redirect/")  # a path here, or a whole URL elsewhere
                self.send_header("Location", target if target.startswith("http") else f"/{target}")
                self.end_headers()
                return
            if path == "/slow":
                stop.wait(slow_s)
            if path == "/slow" or path not in files:
                self.send_response(404 if path != "/slow" else 200)
                self.end_headers()
                return
            kind, body = files[path]
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
