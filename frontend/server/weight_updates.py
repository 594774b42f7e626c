"""vLLM's dev-mode routes for RL weight updates (docs/rl-weight-updates.md), served with the developer
endpoints (ENGINE_SERVER_DEV_MODE or VLLM_SERVER_DEV_MODE) behind the API key; --weight-transfer-config
turns them on. Each is a UTILITY call (engine_core/weight_updates.py): the engine orders the steps, its
ranks do the transfer.

POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size}}
POST /start_weight_update {"is_checkpoint_format": true, "mode": "abort" | "wait" | "keep"}
POST /update_weights {"update_info": {names, dtype_names, shapes, packed, ...}}
POST /finish_weight_update, POST /update_weight_version {"version"}, GET /weight_info, GET /get_world_size
(the engine's worker ranks: a trainer's group is one more). POST /abort_requests is the tokens door's.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from frontend.openai.common import json_response
from frontend.server.admin import Deps
from frontend.server.errors import OpenAIError

router = APIRouter()
# a rendezvous waits for the trainer, an update for its broadcasts; the engine's own timeout
# (--weight-transfer-config timeout_s) ends either first
TRANSFER_CALL_S = 24 * 3600.0


class InitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


class StartBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    is_checkpoint_format: bool = True
    mode: Literal["abort", "wait", "keep"] = "keep"  # as /pause's; ignored when the engine is paused already


class UpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: dict[str, Any]


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | int


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitBody, deps: Deps) -> Response:
    group = await deps.client.call_utility("init_weight_transfer", body.init_info, timeout_s=TRANSFER_CALL_S)
    return json_response(group)


@router.post("/start_weight_update")
async def start_weight_update(deps: Deps, body: StartBody | None = None) -> Response:
    body = body or StartBody()
    if not body.is_checkpoint_format:
        raise OpenAIError(
            "is_checkpoint_format false is not supported: send the checkpoint's (Hugging Face) names and layouts.",
            param="is_checkpoint_format",
        )
    return json_response(await deps.client.call_utility("start_weight_update", body.mode))


@router.post("/update_weights")
async def update_weights(body: UpdateBody, deps: Deps) -> Response:
    info = {"is_checkpoint_format": True, **body.update_info}
    return json_response(await deps.client.call_utility("update_weights", info, timeout_s=TRANSFER_CALL_S))


@router.post("/finish_weight_update")
async def finish_weight_update(deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("finish_weight_update", timeout_s=TRANSFER_CALL_S))


@router.post("/update_weight_version")
async def update_weight_version(body: VersionBody, deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("update_weight_version", str(body.version)))


@router.get("/weight_info")
async def weight_info(deps: Deps) -> Response:
    return json_response(await deps.client.call_utility("weight_info"))


@router.get("/get_world_size")
async def get_world_size(deps: Deps) -> Response:
    info = await deps.client.call_utility("weight_info")
    return json_response({"world_size": info["world_size"]})
