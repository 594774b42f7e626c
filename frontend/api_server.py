"""One API-server process: FastAPI + uvicorn on the listening socket the launcher hands down.

`python -m frontend.api_server FD` reads its ServerConfig as JSON on stdin; FD is the shared,
already-listening TCP socket (N processes accept on it, the kernel spreads the connections).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from frontend.async_client import SHUTDOWN_REASON, AsyncEngineClient
from frontend.metrics import UNMETERED_PATHS, EngineStatsCollector, Metrics, render
from frontend.model_files import load_generation_defaults, load_tokenizer
from frontend.openai_models import DetokenizeRequest, OpenAIError, TokenizeRequest
from frontend.routes_openai import json_response, router
from frontend.serving import AdmissionLimits, OpenAIServing
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
    api_keys: list[str] = []  # any of them opens the API; empty: no key needed
    chat_template: str | None = None  # a template string (the launcher reads --chat-template files)
    allowed_origins: list[str] = []
    tokenizer_cache_dir: str | None = None
    log_level: str = "warning"
    register_timeout_s: float = 600.0
    generation_config: str = "auto"  # "auto" (the model's generation_config.json), "vllm" (none) or a folder
    log_format: str = "text"
    log_requests: bool = True  # per-request lines at debug level
    max_request_body_bytes: int = 16 << 20  # larger bodies get 413 before they are parsed
    max_queued_requests: int = 0  # admission control, 0 = none (see AdmissionLimits)
    max_queued_tokens: int = 0
    max_inflight_requests: int = 0
    shutdown_timeout_s: float = 30.0  # SIGTERM: open requests may finish this long, then are aborted
    engine_stall_timeout_s: float = 120.0  # open requests and no engine step this long: /health 503
    enable_docs: bool = True  # /docs, /redoc and /openapi.json


@dataclass
class AppDeps:
    config: ServerConfig
    client: AsyncEngineClient
    serving: OpenAIServing
    metrics: Metrics | None = None


def error_response(error: OpenAIError) -> Response:
    return Response(
        msgspec.json.encode(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


class EdgeMiddleware:
    """API keys (constant-time compare), the request-body size limit, X-Request-Id echo, which API
    server answered, and HTTP metrics.

    Pure ASGI rather than BaseHTTPMiddleware, which hides client disconnects from the handlers.
    """

    def __init__(
        self,
        app: Any,
        api_keys: list[str],
        server_index: int,
        metrics: Metrics | None = None,
        max_body_bytes: int = 16 << 20,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        self.server_header = str(server_index).encode()
        self.max_body_bytes = max_body_bytes

    def authorized(self, header: bytes) -> bool:
        # Every key is compared, in constant time: the answer's timing tells nothing of any key.
        matches = [hmac.compare_digest(header, expected) for expected in self.expected]
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

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
                status[0] = message["status"]
            await send(message)

        try:
            if self.expected and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
                if not self.authorized(headers.get(b"authorization", b"")):
                    error = OpenAIError(
                        "Incorrect or missing API key.",
                        status=401,
                        type="authentication_error",
                        code="invalid_api_key",
                    )
                    await error_response(error)(scope, receive, send_with_headers)
                    return
            body_receive = await self._read_body(scope, headers, receive)
            if body_receive is None:
                error = OpenAIError(
                    f"The request body is larger than {self.max_body_bytes} bytes.",
                    status=413,
                    type="invalid_request_error",
                    code="request_too_large",
                )
                await error_response(error)(scope, receive, send_with_headers)
                return
            await self.app(scope, body_receive, send_with_headers)
        finally:
            path = scope["path"]
            if self.metrics is not None and path not in UNMETERED_PATHS:
                self.metrics.http_requests.labels(scope["method"], path, str(status[0])).inc()
                self.metrics.http_latency.labels(scope["method"], path).observe(time.monotonic() - started)

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


def build_app(deps: AppDeps) -> FastAPI:
    config = deps.config
    docs = config.enable_docs
    app = FastAPI(
        title="engine",
        version=__version__,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.deps = deps
    app.add_middleware(
        EdgeMiddleware,
        api_keys=config.api_keys,
        server_index=config.server_index,
        metrics=deps.metrics,
        max_body_bytes=config.max_request_body_bytes,
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
        client, problem = deps.client, None
        if client.is_dead:
            problem = (f"engine is dead: {client.dead_reason}", "engine_dead")
        elif deps.serving.draining:
            problem = ("the server is shutting down", "server_shutting_down")
        elif (stalled := client.stalled_for()) > config.engine_stall_timeout_s:
            problem = (
                f"engine has made no progress for {stalled:.0f} s with requests open",
                "engine_stalled",
            )
        if problem is not None:
            return error_response(
                OpenAIError(problem[0], status=503, type="service_unavailable_error", code=problem[1])
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


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with a drain on the first SIGTERM/SIGINT: readiness and new requests answer 503,
    open requests may finish within timeout_s, the rest end with finish_reason "abort" (and [DONE] when
    streamed); then uvicorn's own graceful exit. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, timeout_s: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.timeout_s = timeout_s
        self.drain_requested = False
        self.drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_requested:
            super().handle_exit(sig, frame)
        self.drain_requested = True  # acted on by on_tick, inside the event loop

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self.drain_task is None:
            self.drain_task = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        self.serving.draining = True
        client = self.serving.client
        logger.info("draining: %d requests open, up to %.0f s", client.num_open_requests, self.timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while client.num_open_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        aborted = await client.abort_all(SHUTDOWN_REASON)
        if aborted:
            logger.warning("drain timeout: aborted %d open requests", aborted)
        self.should_exit = True


async def serve(config: ServerConfig, sock: socket.socket) -> None:
    client = AsyncEngineClient(
        config.input_address, config.output_address, f"api{config.server_index}-{os.getpid()}"
    )
    try:
        model_info = await client.register(config.register_timeout_s)
    except TimeoutError as error:
        raise SystemExit(
            f"API server {config.server_index}: no engine answered at {config.input_address} "
            f"within {config.register_timeout_s:.0f} s ({error}). Is the address right, and is the engine up?"
        ) from None
    tokenizer = await asyncio.to_thread(
        load_tokenizer, config.model or model_info.model, config.tokenizer_cache_dir
    )
    defaults = load_generation_defaults(config.model or model_info.model, config.generation_config)
    if defaults:
        logger.info("sampling defaults from the generation config: %s", defaults)
    metrics = Metrics(model_info)
    serving = OpenAIServing(client, tokenizer, model_info, config.chat_template, defaults, metrics)
    serving.log_requests = config.log_requests
    serving.limits = AdmissionLimits(
        max_queued_requests=config.max_queued_requests,
        max_queued_tokens=config.max_queued_tokens,
        max_inflight_requests=config.max_inflight_requests,
    )
    app = build_app(AppDeps(config, client, serving, metrics))
    uv_config = uvicorn.Config(
        app, log_level=config.log_level, loop="uvloop", access_log=False, timeout_graceful_shutdown=10
    )
    server = DrainingServer(uv_config, serving, config.shutdown_timeout_s)
    # The launcher's word that the engine process is gone: fail open requests now, not after the
    # heartbeat timeout.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, client.mark_dead, "the engine process exited"
    )
    # Startup's objects (FastAPI, transformers' modules, the tokenizer: ~350K) live as long as we do; a
    # full collection walked them in 230-290 ms, a stall of every stream. Frozen, it walks only new ones.
    gc.collect()
    gc.freeze()
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
