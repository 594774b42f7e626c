"""What every OpenAI route shares: its serving dependency, JSON bodies, the client-disconnect watch
of a non-streaming request, and the request-id headers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import Depends, Request
from fastapi.responses import Response

from frontend.openai.schemas import METADATA_FIELDS, SamplingFields
from frontend.openai.serving import OpenAIServing
from frontend.server.errors import OpenAIError, to_openai_error

_encoder = msgspec.json.Encoder()


@dataclass
class Run:
    """One request on its way: what every body and chunk of its response repeats."""

    serving: OpenAIServing
    request_id: str
    model: str
    created: int

    def envelope(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        fingerprint = self.serving.system_fingerprint
        return {**body, "system_fingerprint": fingerprint, "choices": choices, **extra}


async def get_serving(request: Request) -> OpenAIServing:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop for every request.
    return request.app.state.deps.serving  # type: ignore[no-any-return]


Serving = Annotated[OpenAIServing, Depends(get_serving)]


def json_response(body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), media_type="application/json", headers=headers)


def caller_request_id(request: Request, body: SamplingFields) -> str | None:
    """The caller's own id for this request (X-Request-Id, else the body's request_id): for logs and
    the X-Request-Id response header, never the engine's key."""
    return request.headers.get("x-request-id") or body.request_id


def id_headers(request: Request, body: SamplingFields) -> dict[str, str] | None:
    """Echo the body's request_id when no header carried one (the middleware echoes the header), and when
    a header can carry it (printable ASCII: HTTP headers are latin-1, and a line break would split them)."""
    if body.request_id and not request.headers.get("x-request-id") and header_safe(body.request_id):
        return {"X-Request-Id": body.request_id}
    return None


def header_safe(text: str) -> bool:
    return all(" " <= c <= "~" for c in text)


def echoes_request_id(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """A route whose errors carry the body's request_id as X-Request-Id, as its answers do (the edge
    middleware only knows the header's): the 400s of its own checks and the engine's refusals. The route
    takes `body` (with a request_id field) and `request`."""

    signature = inspect.signature(route)

    @functools.wraps(route)  # FastAPI reads the route's own signature through __wrapped__
    async def route_echoing_its_id(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except Exception as error:
            given = signature.bind(*args, **kwargs).arguments
            headers = id_headers(given["request"], given["body"])
            if headers is None:
                raise
            echoed = to_openai_error(error)
            echoed.headers = {**headers, **echoed.headers}
            raise echoed from error

    return route_echoing_its_id


def metadata_of(body: SamplingFields) -> dict[str, Any]:
    return {name: getattr(body, name) for name in METADATA_FIELDS if getattr(body, name) is not None}


async def until_disconnected(request: Request, work: Any) -> Any:
    """Await `work` (a non-streaming generation); if the client goes away first, cancel it, which
    aborts its engine requests (their blocks are freed)."""
    task = asyncio.ensure_future(work)
    # NOTE: the body is already read, so the next ASGI message is the disconnect (as in Starlette's
    # StreamingResponse); Request.is_disconnected() uses a cancel scope that can leak cancellations.
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise OpenAIError("The client disconnected.", status=499, type="client_closed_request")
        return task.result()
    except OpenAIError:
        raise
    except Exception as error:
        raise to_openai_error(error) from error
    finally:
        for pending in (task, disconnect):
            if not pending.done():
                pending.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
