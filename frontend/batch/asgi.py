"""One HTTP request to an ASGI app in this process, without a socket: how `engine run-batch` puts each
line through the API server's own app (routing, validation, the doors, the error shape), exactly as a
request over HTTP would go."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AppResponse:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False  # the app sent its last body message


async def call_app(
    app: Any, method: str, path: str, body: bytes, content_type: str = "application/json"
) -> AppResponse:
    """Send one request; the whole response. The caller never disconnects: after the body, receive()
    waits until the app is done (a door that watches for a disconnect sees none)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
        "client": None,
        "server": None,
    }
    sent_body = False
    done = asyncio.Event()
    response = AppResponse()

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    chunks: list[bytes] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            response.status = int(message["status"])
            response.headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message["headers"]
            }
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                response.body = b"".join(chunks)
                response.complete = True

    try:
        await app(scope, receive, send)
    except Exception:
        # Starlette re-raises an unhandled error after its handler has sent the 500 body; that answer
        # stands. Without one, the caller reports the error itself.
        if not response.complete:
            raise
    finally:
        done.set()
    return response
