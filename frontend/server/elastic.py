"""POST /scale_elastic_ep {"new_data_parallel_size", "drain_timeout"} and POST /is_scaling_elastic_ep:
vLLM's routes for elastic data parallel (docs/parallel.md). The launcher does the scale
(frontend/engine/elastic.py): this API server asks it over its control socket and answers when it is
done. While the engines change, every frontend answers new requests 503 with Retry-After (admission)."""

from __future__ import annotations

import json

import zmq
import zmq.asyncio
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from frontend.openai.common import json_response
from frontend.server.admin import Deps
from frontend.server.errors import OpenAIError

router = APIRouter()
SCALE_CALL_S = 1800.0  # beyond drain_timeout: engines loading their model


class ScaleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_data_parallel_size: int = Field(ge=1)
    drain_timeout: float = Field(default=120, ge=0)  # seconds the leaving engines may finish their requests


@router.post("/scale_elastic_ep")
async def scale_elastic_ep(body: ScaleBody, deps: Deps) -> Response:
    address = deps.config.control_address
    if not address:
        raise OpenAIError(
            "This server cannot scale its engines: start `engine serve` with --enable-elastic-ep, and send the "
            "scale to one of its own API servers (not to a frontend attached from elsewhere).",
            param="new_data_parallel_size",
        )
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        await socket.send_multipart([b"", json.dumps(body.model_dump()).encode()])
        if not await socket.poll(int((SCALE_CALL_S + body.drain_timeout) * 1000)):
            raise OpenAIError("The launcher did not answer the scale.", status=504, type="timeout_error")
        _, answer_bytes = await socket.recv_multipart()
    finally:
        socket.close()
    answer = json.loads(answer_bytes)
    if "error" in answer:
        status = 500 if answer.get("failed") else 400
        raise OpenAIError(answer["error"], status=status, param=answer.get("param"),
                          type="internal_error" if status == 500 else "invalid_request_error")  # fmt: skip
    size = answer["data_parallel_size"]
    return json_response({"message": f"Scaled to {size} data parallel engines", "data_parallel_size": size})


@router.post("/is_scaling_elastic_ep")
async def is_scaling_elastic_ep(deps: Deps) -> Response:
    return json_response({"is_scaling_elastic_ep": bool(getattr(deps.client, "scaling", False))})
