"""Developer endpoints, served only when the launcher saw ENGINE_SERVER_DEV_MODE=1 (or vLLM's
VLLM_SERVER_DEV_MODE=1): GET /server_info, what this API server runs with (vLLM's, in our terms), and
POST /reset_prefix_cache (vLLM's: the engine drops every cached block no request holds), and POST
/reset_mm_cache (vLLM's: the API server forgets the images it has processed; empty 200).

It shows configuration and the machine, never a secret: API keys are counted, not shown, and
environment variables whose names hold KEY, TOKEN, SECRET or PASSWORD are left out.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import APIRouter
from fastapi.responses import Response

from frontend.collect_env import collect
from frontend.openai.common import json_response
from frontend.server.admin import Deps

router = APIRouter()


def server_info(deps: Any) -> dict[str, Any]:
    config = msgspec.to_builtins(deps.config)
    config["api_keys"] = f"{len(deps.config.api_keys)} key(s)"
    info = deps.serving.model_info
    return {
        "engine": {name: getattr(info, name) for name in info.__struct_fields__},
        "server": config,
        "system_fingerprint": deps.serving.system_fingerprint,
    }


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(deps: Deps) -> Response:
    """200 {"reset": true} once the engine's prefix cache is empty; {"reset": false} when running requests
    hold cached blocks (the engine then keeps its cache: reset when they are done)."""
    reset = await deps.client.call_utility("reset_prefix_cache")
    return json_response({"reset": bool(reset)})


@router.post("/reset_mm_cache")
async def reset_mm_cache(deps: Deps) -> Response:
    """This API server's cache of processed images, emptied (each API server process keeps its own)."""
    if deps.serving.images is not None:
        deps.serving.images.model.cache.reset()
    return Response(status_code=200)


@router.get("/server_info")
async def show_server_info(deps: Deps) -> Response:
    body = server_info(deps)
    body["system_env"] = await asyncio.to_thread(collect)  # torch is asked in a subprocess: seconds
    return json_response(body)
