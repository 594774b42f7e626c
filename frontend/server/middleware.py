"""EdgeMiddleware: API keys (constant-time compare), the request-body size limit, X-Request-Id echo,
which API server answered, the data-parallel engine a request names (X-data-parallel-rank), and HTTP
metrics.

Pure ASGI rather than BaseHTTPMiddleware, which hides client disconnects from the handlers.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import MutableMapping
from typing import Any

from starlette.routing import Match

from frontend.engine.data_parallel import REQUESTED_RANK
from frontend.metrics import UNMETERED_PATHS, Metrics
from frontend.server.errors import OpenAIError, error_response

OPEN_PATHS = {"/health", "/ping", "/version", "/metrics"}


def route_path(scope: MutableMapping[str, Any]) -> str:
    """The path without the --root-path prefix, whether the proxy stripped it or not (Starlette's rule)."""
    path, root = str(scope["path"]), str(scope.get("root_path") or "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        return path[len(root) :] or "/"
    return path


class EdgeMiddleware:
    def __init__(
        self,
        app: Any,
        api_keys: list[str],
        server_index: int,
        metrics: Metrics | None = None,
        max_body_bytes: int = 16 << 20,
        routes: list[Any] | None = None,
        num_engines: int = 1,
    ) -> None:
        self.app = app
        self.num_engines = num_engines  # the data-parallel engines an X-data-parallel-rank may name
        self.routes = routes if routes is not None else []  # the app's, to label metrics by route
        self.metrics = metrics
        self.keys = [key.encode() for key in api_keys]
        self.server_header = str(server_index).encode()
        self.max_body_bytes = max_body_bytes

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        """`Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's header; vLLM takes either)."""
        bearer = headers.get(b"authorization", b"")
        offered = [bearer[7:] if bearer[:7].lower() == b"bearer " else b"", headers.get(b"x-api-key", b"")]
        # Every key is compared, in constant time: the answer's timing tells nothing of any key.
        matches = [hmac.compare_digest(given, key) for given in offered for key in self.keys]
        return any(matches)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id") or os.urandom(8).hex().encode()
        extra = [(b"x-request-id", request_id), (b"x-engine-server", self.server_header)]

        status = [500]
        started = time.monotonic()

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = [
                    *message.get("headers", []),
                    *(pair for pair in extra if pair[0] not in present),
                ]
                status[0] = message["status"]
            await send(message)

        try:
            if self.keys and route_path(scope) not in OPEN_PATHS and scope["method"] != "OPTIONS":
                if not self.authorized(headers):
                    error = OpenAIError(
                        "Incorrect or missing API key.",
                        status=401,
                        type="authentication_error",
                        code="invalid_api_key",
                    )
                    await error_response(error, scope["path"])(scope, receive, send_with_headers)
                    return
            body_receive = await self._read_body(scope, headers, receive)
            if body_receive is None:
                error = OpenAIError(
                    f"The request body is larger than {self.max_body_bytes} bytes.",
                    status=413,
                    type="invalid_request_error",
                    code="request_too_large",
                )
                await error_response(error, scope["path"])(scope, receive, send_with_headers)
                return
            rank = headers.get(b"x-data-parallel-rank")
            if rank is not None and (engine := self.engine_rank(rank)) is None:
                error = OpenAIError(
                    f"X-data-parallel-rank must be an engine rank in [0, {self.num_engines}).",
                    param="X-data-parallel-rank",
                )
                await error_response(error, scope["path"])(scope, receive, send_with_headers)
                return
            token = REQUESTED_RANK.set(engine if rank is not None else None)
            try:
                await self.app(scope, body_receive, send_with_headers)
            finally:
                REQUESTED_RANK.reset(token)
        finally:
            path = self.route_label(scope)
            if self.metrics is not None and path not in UNMETERED_PATHS:
                self.metrics.http_requests.labels(scope["method"], path, str(status[0])).inc()
                self.metrics.http_latency.labels(scope["method"], path).observe(time.monotonic() - started)

    def engine_rank(self, value: bytes) -> int | None:
        """X-data-parallel-rank (vLLM's header): the engine to run the request on; None when it names none."""
        try:
            rank = int(value)
        except ValueError:
            return None
        return rank if 0 <= rank < self.num_engines else None

    def route_label(self, scope: dict[str, Any]) -> str:
        """The route's template (/v1/responses/{response_id}), not the path: one series per route, however
        many ids and stray paths are asked for ("unmatched"). A request the edge itself refused (401, 413)
        never reached routing: its route is looked up here."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] != Match.NONE), None)
        path = getattr(route, "path", None)
        return path if isinstance(path, str) else "unmatched"

    async def _read_body(self, scope: dict[str, Any], headers: dict[bytes, bytes], receive: Any) -> Any:
        """Read the whole body, at most max_body_bytes; a receive() that replays it, or None if too big."""
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)  # the client left while sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    """A receive() that returns `messages` first, then whatever the connection sends next."""
    pending = list(messages)

    async def replay() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()  # type: ignore[no-any-return]

    return replay
