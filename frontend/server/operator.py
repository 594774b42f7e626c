"""The operator's engine controls (vLLM's), served with the developer endpoints (ENGINE_SERVER_DEV_MODE or
VLLM_SERVER_DEV_MODE), behind the API key. Each is a UTILITY call: the engine owns the state, so every API
server and attached frontend sees it with its next request (the engine tells them at once).

POST /pause?mode=abort|wait|keep, POST /resume, GET /is_paused; POST /sleep?level=1|2, POST /wake_up
(?tags=weights&tags=kv_cache), GET /is_sleeping; POST /collective_rpc {"method", "args", "kwargs",
"timeout"}; POST /start_profile, POST /stop_profile (the worker's torch profiler, --profiler-dir).
docs/operations.md lists bodies, status codes and costs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from frontend.openai.common import json_response
from frontend.server.admin import Deps
from frontend.server.errors import OpenAIError

router = APIRouter()
SLOW_CALL_S = 600.0  # sleep and wake write or read the weights: seconds for a large model
WAIT_POLL_S = 0.05


def _query(request: Request, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise OpenAIError(f"{unknown[0]} is not a parameter of {request.url.path}.", param=unknown[0])


def _number(request: Request, name: str, default: float) -> float:
    text = request.query_params.get(name)
    try:
        return default if text is None else float(text)
    except ValueError:
        raise OpenAIError(f"{name} must be a number, not {text!r}.", param=name) from None


@router.post("/pause")
async def pause(request: Request, deps: Deps) -> Response:
    """abort: open requests end now (finish_reason "abort") and new ones get 503 until /resume; wait: the
    answer comes once the running requests are done, new ones queue; keep: running ones freeze in place."""
    _query(request, ("mode", "timeout"))
    mode = request.query_params.get("mode", "abort")
    timeout_s = _number(request, "timeout", SLOW_CALL_S)
    state = await deps.client.call_utility("pause", mode)
    deadline = time.monotonic() + timeout_s
    while mode == "wait" and state["num_running"] and time.monotonic() < deadline:
        await asyncio.sleep(WAIT_POLL_S)
        state = await deps.client.call_utility("is_paused")
    return json_response(state)


@router.post("/resume")
async def resume(deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("resume"))


@router.get("/is_paused")
async def is_paused(deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("is_paused"))


@router.post("/sleep")
async def sleep(request: Request, deps: Deps) -> Response:
    """level 1: the weights go to a file and the KV cache's memory back to the system; level 2: the weights
    are dropped (reloaded from the checkpoint on wake). 400 while requests are open."""
    _query(request, ("level", "mode"))
    if "mode" in request.query_params:
        raise OpenAIError("mode is not supported by /sleep: POST /pause?mode=... first.", param="mode")
    level = _number(request, "level", 1)
    if level != int(level):
        raise OpenAIError("level must be 1 or 2.", param="level")
    return json_response(await deps.client.call_utility("sleep", int(level), timeout_s=SLOW_CALL_S))


@router.post("/wake_up")
async def wake_up(request: Request, deps: Deps) -> Response:
    _query(request, ("tags",))
    tags = request.query_params.getlist("tags") or None
    return json_response(await deps.client.call_utility("wake_up", tags, timeout_s=SLOW_CALL_S))


@router.get("/is_sleeping")
async def is_sleeping(deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("is_sleeping"))


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


@router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRpcRequest, deps: Deps) -> Response:
    """{"results": [one per worker]}; only the engine's COLLECTIVE_RPC_METHODS (read-only reports)."""
    wait_s = (body.timeout or SLOW_CALL_S) + 5
    results = await deps.client.call_utility(
        "collective_rpc", body.method, body.args, body.kwargs, body.timeout, timeout_s=wait_s
    )
    return json_response(results)


@router.post("/start_profile")
async def start_profile(deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("start_profile"))


@router.post("/stop_profile")
async def stop_profile(deps: Deps) -> Response:
    """Writes the worker's trace (Chrome trace JSON) under --profiler-dir; the body names the file."""
    return json_response(await deps.client.call_utility("stop_profile", timeout_s=SLOW_CALL_S))
