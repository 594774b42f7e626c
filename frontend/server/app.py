"""build_app: the FastAPI app of one API server: middleware, the error shape, every door's router."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from frontend.anthropic import messages
from frontend.audio import realtime as audio_realtime
from frontend.audio import routes as audio_routes
from frontend.openai import chat, chat_batch, completions, invocations, tokenize
from frontend.openai.common import header_safe
from frontend.pooling import embeddings as pooling_embeddings
from frontend.pooling import score as pooling_score
from frontend.pooling.routes import absent_router
from frontend.responses import serving as responses
from frontend.scale_out import derender, generate, render, scoring
from frontend.server import admin, dev, elastic, lora, operator, weight_updates
from frontend.server.deps import AppDeps
from frontend.server.errors import OpenAIError, error_response, http_status_error, to_openai_error
from frontend.server.middleware import EdgeMiddleware
from frontend.server.orca import OrcaMiddleware
from frontend.server.user_middleware import add_user_middleware
from protocol.version import __version__


def build_app(deps: AppDeps) -> FastAPI:
    config = deps.config
    docs = config.enable_docs
    app = FastAPI(
        title="engine",
        version=__version__,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        root_path=config.root_path,  # behind a proxy that serves us under a prefix (stripped or not)
    )
    app.state.deps = deps
    routes: list[Any] = []  # every door's routes, for the metrics' route labels
    client = deps.client
    app.add_middleware(OrcaMiddleware, stats=lambda: client.last_stats)
    app.add_middleware(
        EdgeMiddleware,
        api_keys=config.api_keys,
        server_index=config.server_index,
        metrics=deps.metrics,
        max_body_bytes=body_limit(config.max_request_body_bytes, deps.serving),
        routes=routes,  # filled in below, with the routers
        num_engines=max(1, len(deps.serving.model_info.data_parallel_addresses)),
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    add_user_middleware(app, config.middleware)  # outermost, as vLLM adds them

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> Response:
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        path = request.url.path
        first = error.errors()[0] if error.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(OpenAIError("The request body is not valid JSON.", param=None), path)
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        invalid = OpenAIError(message, param=location[0] if location else None)
        # the body's request_id, as an answer would echo it (the middleware put the header's, if any)
        given = error.body.get("request_id") if isinstance(error.body, dict) else None
        if isinstance(given, str) and given and "x-request-id" not in request.headers and header_safe(given):
            invalid.headers = {"X-Request-Id": given}
        return error_response(invalid, path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        return error_response(to_openai_error(error), request.url.path)  # logged there, with its traceback

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return error_response(http_status_error(error.status_code, error.detail), request.url.path)

    if config.tokens_only:  # vLLM's --tokens-only: the tokens-in/tokens-out doors alone
        doors = [generate.router, generate.abort_router]
    elif config.render_only:  # `engine launch render`: no engine to generate with
        doors = [render.router]
    elif deps.serving.model_info.runner == "pooling":
        doors = [pooling_embeddings.router, pooling_score.router]
    elif deps.serving.model_info.runner == "transcription":
        doors = [audio_routes.router, audio_realtime.router]
    else:
        doors = [
            chat.router,
            chat_batch.router,
            completions.router,
            responses.router,
            messages.router,
            invocations.router,
            generate.router,
            render.router,
            derender.router,
            scoring.router,
        ]
    routers = [*doors, absent_router(deps.serving.model_info), tokenize.router, admin.router, elastic.router]
    routers += [tokenize.info_router] if config.enable_tokenizer_info_endpoint else []
    routers += [dev.router, operator.router, weight_updates.router] if config.dev_mode else []
    if config.dev_mode and not config.tokens_only and generate.abort_router not in doors:
        routers.append(generate.abort_router)  # POST /abort_requests, for RL loops
    routers += [lora.router] if config.runtime_lora_updating else []
    for router in routers:
        app.include_router(router)
        routes.extend(router.routes)
    return app


def body_limit(configured: int, serving: Any) -> int:
    """A speech model's server takes an upload of the audio limit's size (25 MB), with room for the form."""
    limits = serving.audio_limits
    return configured if serving.speech is None else max(configured, limits.max_file_bytes + (1 << 20))
