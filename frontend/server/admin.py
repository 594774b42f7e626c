"""Operator endpoints: GET /health (503 when the engine is dead, stalled or the server drains; 200 with a
detail when it serves in a lesser way, e.g. without the csrc kernels), GET and
POST /ping (SageMaker's health check, the same answer), /metrics (Prometheus, the whole server),
/version, /load."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from frontend.metrics import render
from frontend.openai.common import json_response
from frontend.server.deps import AppDeps
from frontend.server.errors import OpenAIError, error_response
from protocol.version import __version__

router = APIRouter()


async def get_deps(request: Request) -> AppDeps:
    return request.app.state.deps  # type: ignore[no-any-return]


Deps = Annotated[AppDeps, Depends(get_deps)]


@router.get("/health")
async def health(deps: Deps) -> Response:
    client, problem = deps.client, None
    if client.is_dead:
        problem = (f"engine is dead: {client.dead_reason}", "engine_dead")
    elif deps.serving.draining:
        problem = ("the server is shutting down", "server_shutting_down")
    elif (stalled := client.stalled_for()) > deps.config.engine_stall_timeout_s:
        problem = (f"engine has made no progress for {stalled:.0f} s with requests open", "engine_stalled")
    if problem is not None:
        return error_response(
            OpenAIError(problem[0], status=503, type="service_unavailable_error", code=problem[1])
        )
    stats = client.last_stats
    if stats is not None and (stats.sleeping or stats.paused):  # on purpose: alive, not serving new work
        status = "asleep" if stats.sleeping else "paused"
        detail = (
            f"level {stats.sleep_level}; POST /wake_up"
            if stats.sleeping
            else f"mode {stats.paused}; POST /resume"
        )
        return json_response({"status": status, "detail": detail})
    notices = deps.serving.model_info.notices
    if notices:  # healthy, but not as fast or as exact as it could be: says why (e.g. no csrc kernels)
        return json_response({"status": "ok", "detail": " ".join(notices)})
    return Response(status_code=200)


@router.get("/ping")
@router.post("/ping")
async def ping(deps: Deps) -> Response:
    return await health(deps)


@router.get("/metrics")
async def metrics(deps: Deps) -> Response:
    return Response(render(deps.stats_collector), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


@router.get("/load")
async def load(deps: Deps) -> Response:
    stats = deps.client.last_stats
    return json_response(
        {
            "server_index": deps.config.server_index,
            "server_load": deps.client.num_open_requests,
            "engine": None if stats is None else {f: getattr(stats, f) for f in stats.__struct_fields__},
        }
    )
