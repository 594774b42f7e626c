"""One API-server process: FastAPI + uvicorn on the listening socket the launcher hands down.

`python -m frontend.api_server FD` reads its ServerConfig as JSON on stdin; FD is the shared,
already-listening TCP socket (N processes accept on it, the kernel spreads the connections).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from frontend.async_client import AsyncEngineClient
from frontend.metrics import UNMETERED_PATHS, EngineStatsCollector, Metrics, render
from frontend.model_files import load_generation_defaults, load_tokenizer
from frontend.openai_models import DetokenizeRequest, OpenAIError, TokenizeRequest
from frontend.routes_openai import json_response, router
from frontend.serving import OpenAIServing
from protocol.log_format import configure_logging
from protocol.version import __version__

logger = logging.getLogger("engine.api")

OPEN_PATHS = {"/health", "/ping", "/version", "/metrics"}


class ServerConfig(msgspec.Struct, kw_only=True):
    """What the launcher tells each API server."""

    model: str  # path, for the tokenizer; "" takes the model the engine reports
    input_address: str
    output_address: str
    server_index: int = 0
    api_key: str | None = None
    chat_template: str | None = None  # a template string (the launcher reads --chat-template files)
    allowed_origins: list[str] = []
    tokenizer_cache_dir: str | None = None
    log_level: str = "warning"
    register_timeout_s: float = 600.0
    generation_config: str = "auto"  # "auto" (the model's generation_config.json), "vllm" (none) or a folder
    log_format: str = "text"
    log_requests: bool = True  # per-request lines at debug level


@dataclass
class AppDeps:
    config: ServerConfig
    client: AsyncEngineClient
    serving: OpenAIServing
    metrics: Metrics | None = None


def error_response(error: OpenAIError) -> Response:
    return Response(
        msgspec.json.encode(error.body()), status_code=error.status, media_type="application/json"
    )


class EdgeMiddleware:
    """API key (constant-time compare), X-Request-Id echo, and which API server answered.

    Pure ASGI rather than BaseHTTPMiddleware, which hides client disconnects from the handlers.
    """

    def __init__(
        self, app: Any, api_key: str | None, server_index: int, metrics: Metrics | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.server_header = str(server_index).encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id") or os.urandom(8).hex().encode()
        extra = [(b"x-request-id", request_id), (b"x-engine-server", self.server_header)]

        status = [500]
        started = time.monotonic()

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
                status[0] = message["status"]
            await send(message)

        if self.expected is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                error = OpenAIError(
                    "Incorrect or missing API key.",
                    status=401,
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send_with_headers)
                return
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            path = scope["path"]
            if self.metrics is not None and path not in UNMETERED_PATHS:
                self.metrics.http_requests.labels(scope["method"], path, str(status[0])).inc()
                self.metrics.http_latency.labels(scope["method"], path).observe(time.monotonic() - started)


def build_app(deps: AppDeps) -> FastAPI:
    app = FastAPI(title="engine", version=__version__, docs_url=None, redoc_url=None)
    app.state.deps = deps
    config = deps.config
    app.add_middleware(
        EdgeMiddleware, api_key=config.api_key, server_index=config.server_index, metrics=deps.metrics
    )
    stats_collector = EngineStatsCollector(
        lambda: deps.client.last_stats, deps.serving.model_info.served_model_names[0]
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> Response:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(OpenAIError(message, param=location[0] if location else None))

    app.include_router(router)

    @app.get("/v1/models")
    async def models() -> Response:
        info = deps.serving.model_info
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "engine",
                "root": info.model,
                "max_model_len": info.max_model_len,
            }
            for name in info.served_model_names
        ]
        return json_response({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if deps.client.is_dead:
            return error_response(
                OpenAIError(
                    f"engine is dead: {deps.client.dead_reason}",
                    status=503,
                    type="service_unavailable_error",
                    code="engine_dead",
                )
            )
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(stats_collector), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/load")
    async def load() -> Response:
        stats = deps.client.last_stats
        return json_response(
            {
                "server_index": config.server_index,
                "server_load": deps.client.num_open_requests,
                "engine": None if stats is None else {f: getattr(stats, f) for f in stats.__struct_fields__},
            }
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        serving = deps.serving
        serving.model_name(body.model)
        if serving.tokenizer is None:
            raise OpenAIError("This model has no tokenizer.", param="prompt")
        if body.messages is not None:
            from frontend.openai_models import ChatCompletionRequest
            from frontend.routes_openai import chat_prompt

            ids = chat_prompt(
                serving,
                ChatCompletionRequest(
                    messages=body.messages, add_generation_prompt=body.add_generation_prompt
                ),
            )
        elif body.prompt is not None:
            ids = list(
                serving.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            )
        else:
            raise OpenAIError("Give either prompt or messages.", param="prompt")
        return json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": serving.model_info.max_model_len}
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        serving = deps.serving
        serving.model_name(body.model)
        if serving.tokenizer is None:
            raise OpenAIError("This model has no tokenizer.", param="tokens")
        if any(not 0 <= t < serving.model_info.vocab_size for t in body.tokens):
            raise OpenAIError("token ids out of vocabulary.", param="tokens")
        return json_response({"prompt": serving.tokenizer.decode(body.tokens)})

    return app


async def serve(config: ServerConfig, sock: socket.socket) -> None:
    import uvicorn

    client = AsyncEngineClient(
        config.input_address, config.output_address, f"api{config.server_index}-{os.getpid()}"
    )
    model_info = await client.register(config.register_timeout_s)
    tokenizer = await asyncio.to_thread(
        load_tokenizer, config.model or model_info.model, config.tokenizer_cache_dir
    )
    defaults = load_generation_defaults(config.model or model_info.model, config.generation_config)
    if defaults:
        logger.info("sampling defaults from the generation config: %s", defaults)
    metrics = Metrics(model_info)
    serving = OpenAIServing(client, tokenizer, model_info, config.chat_template, defaults, metrics)
    serving.log_requests = config.log_requests
    app = build_app(AppDeps(config, client, serving, metrics))
    uv_config = uvicorn.Config(
        app, log_level=config.log_level, loop="uvloop", access_log=False, timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(uv_config)
    logger.info("API server %d ready", config.server_index)
    try:
        await server.serve(sockets=[sock])
    finally:
        client.close()


def main() -> None:
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=ServerConfig)
    configure_logging(config.log_level, config.log_format)
    sock = socket.socket(fileno=int(sys.argv[1]))
    import uvloop

    uvloop.run(serve(config, sock))


if __name__ == "__main__":
    main()
