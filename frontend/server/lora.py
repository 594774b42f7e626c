"""Runtime LoRA endpoints (vLLM's), served only when the launcher saw ENGINE_ALLOW_RUNTIME_LORA_UPDATING
(or VLLM_ALLOW_RUNTIME_LORA_UPDATING) true; behind the API key like every route but /health.

POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}: 200 and a line of text, or 400
naming the problem (the engine and its worker unchanged). POST /v1/unload_lora_adapter {"lora_name"}:
200, or 404 when no adapter has the name. The engine owns the table: every API server and attached
frontend sees the change with the next request.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from frontend.server.admin import Deps
from frontend.server.errors import OpenAIError

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name (its running requests finish on it)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; our ids are the engine's own, so it is refused


def _check_fields(body: BaseModel) -> None:
    unknown = sorted(body.model_extra or {})
    if unknown:
        raise OpenAIError(f"{unknown[0]} is not a field of this request.", param=unknown[0])


def _require_lora(deps: Any) -> None:
    if not deps.serving.model_info.max_loras:
        raise OpenAIError("LoRA is not enabled: start the server with --enable-lora.", param="lora_name")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, deps: Deps) -> Response:
    _check_fields(body)
    _require_lora(deps)
    base = deps.serving.model_info.served_model_names[0]
    await deps.client.call_utility("load_lora", body.lora_name, body.lora_path, base, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, deps: Deps) -> Response:
    _check_fields(body)
    if body.lora_int_id is not None:
        raise OpenAIError("lora_int_id is not supported: name the adapter by lora_name.", param="lora_int_id")
    _require_lora(deps)
    await deps.client.call_utility("unload_lora", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
