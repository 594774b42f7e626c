"""`engine proxy --prefill URL... --decode URL...`: the router of disaggregated prefill and decode.

Each request goes to a prefill instance first, as vLLM's proxies send it: not streamed, one output token,
and `kv_transfer_params` {"do_remote_decode": true}; the prefill engine computes the prompt, writes its KV
to the connector, and answers with the params a decode engine needs. The request then goes to a decode
instance with those params, and its answer (streamed or not) is the client's. Instances are taken round
robin, each list on its own. The decode instance's answer is what one engine alone would give, token for
token: it loads the prompt's KV but for the last token, and computes the rest itself.

What either side answers with an error (a 4xx of a bad request, a 5xx of a dead engine) reaches the client
as that side's status and body; an instance that does not answer is a 502 naming it. `/health` is 200 only
while every instance answers its own /health.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.config.proxy_args import ProxyArgs

logger = logging.getLogger("engine.proxy")

# what a prefill request carries, as vLLM's toy proxy sends it
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
DOORS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
FORWARDED_HEADERS = ("authorization", "x-request-id", "x-api-key", "x-session-id")


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill instance computes: the prompt, one token, not streamed, KV written out."""
    first = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    first["stream"] = False
    first["kv_transfer_params"] = PREFILL_PARAMS
    if path == "/inference/v1/generate":
        sampling = {k: v for k, v in (body.get("sampling_params") or {}).items() if k != "min_tokens"}
        first["sampling_params"] = {**sampling, "max_tokens": 1}
    else:
        first["max_tokens"] = 1
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
    return first


def error_body(message: str, status: int) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadGateway", "param": None, "code": status}}
    ).encode()


class Proxy:
    def __init__(self, args: ProxyArgs) -> None:
        self.args = args
        self.prefills = itertools.cycle([url.rstrip("/") for url in args.prefill])
        self.decodes = itertools.cycle([url.rstrip("/") for url in args.decode])
        self.session: Any = None  # aiohttp.ClientSession, made in the server's loop

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.args.timeout_s))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The client's answer: a Response, or a StreamingResponse of the decode instance's events."""

        prefill, decode = next(self.prefills), next(self.decodes)
        try:
            async with self.session.post(
                prefill + path, json=prefill_body(path, body), headers=headers
            ) as first:
                answer = await first.read()
                if first.status != 200:
                    return Response(answer, first.status, media_type=first.content_type)
                params = json.loads(answer).get("kv_transfer_params")
        except (TimeoutError, aiohttp.ClientError) as error:
            return Response(error_body(f"prefill instance {prefill}: {error or 'timed out'}", 502), 502,
                            media_type="application/json")  # fmt: skip
        second = {**body, "kv_transfer_params": params}
        try:
            response = await self.session.post(decode + path, json=second, headers=headers)
        except (TimeoutError, aiohttp.ClientError) as error:
            return Response(error_body(f"decode instance {decode}: {error or 'timed out'}", 502), 502,
                            media_type="application/json")  # fmt: skip
        if not body.get("stream") or response.status != 200:
            try:
                return Response(await response.read(), response.status, media_type=response.content_type)
            finally:
                response.release()
        return StreamingResponse(self._relay(response, decode), media_type="text/event-stream")

    async def _relay(self, response: Any, decode: str) -> AsyncIterator[bytes]:
        """The decode instance's events as they come; closing the client's stream closes the instance's,
        which aborts its request there."""
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as error:
            logger.warning("decode instance %s ended the stream: %s", decode, error)
            message = json.dumps({"error": {"message": f"decode instance {decode}: {error}", "code": 502}})
            yield f"data: {message}\n\n".encode()
        finally:
            response.release()

    async def health(self) -> tuple[int, dict[str, Any]]:
        urls = list(dict.fromkeys([url.rstrip("/") for url in (*self.args.prefill, *self.args.decode)]))

        async def one(url: str) -> str:
            try:
                async with self.session.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as answer:
                    return "healthy" if answer.status == 200 else f"unhealthy ({answer.status})"
            except (TimeoutError, aiohttp.ClientError) as error:
                return f"unreachable ({error or 'timed out'})"

        states = dict(zip(urls, await asyncio.gather(*(one(url) for url in urls)), strict=True))
        status = 200 if all(state == "healthy" for state in states.values()) else 503
        return status, {"instances": states}


def proxy_app(args: ProxyArgs) -> FastAPI:

    proxy = Proxy(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        yield
        await proxy.close()

    app = FastAPI(title="engine proxy", lifespan=lifespan)

    async def door(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object", "type": "BadRequestError",
                                           "param": None, "code": 400}}, 400)  # fmt: skip
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        return await proxy.forward(request.url.path, body, headers)

    for path in DOORS:
        app.add_api_route(path, door, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        status, body = await proxy.health()
        return JSONResponse(body, status)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        decode = next(proxy.decodes)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            async with proxy.session.get(decode + "/v1/models", headers=headers) as answer:
                return Response(await answer.read(), answer.status, media_type=answer.content_type)
        except (TimeoutError, aiohttp.ClientError) as error:
            return Response(
                error_body(f"decode instance {decode}: {error}", 502), 502, media_type="application/json"
            )

    return app


def run_proxy(args: ProxyArgs) -> int:
    import uvicorn

    logger.info(
        "proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode
    )
    uvicorn.run(proxy_app(args), host=args.host, port=args.port, log_level="warning")
    return 0
