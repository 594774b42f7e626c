"""POST /v1/embeddings (OpenAI's), /pooling and /classify (vLLM's): inputs -> pooled values.

Every input of a request runs at once, so the engine batches them; `data[i]` answers `input[i]`.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.openai.common import Serving, json_response
from frontend.openai.serving import OpenAIServing
from frontend.pooling.schemas import ClassifyRequest, EmbeddingRequest, PoolingRequest
from frontend.pooling.serving import check_task, envelope, pool_all, render_inputs
from frontend.server.errors import OpenAIError
from protocol.pooling import PoolingParams

router = APIRouter()


def embedding_params(serving: OpenAIServing, body: EmbeddingRequest) -> PoolingParams:
    info = serving.model_info
    dims = body.dimensions
    if dims is not None:
        sizes = info.pooler.matryoshka_dimensions if info.pooler is not None else []
        if not sizes:
            raise OpenAIError(
                f"The model `{info.served_model_names[0]}` does not support Matryoshka embeddings: "
                "dimensions cannot be set.",
                param="dimensions",
            )
        if dims not in sizes and dims != info.hidden_size:
            raise OpenAIError(f"dimensions must be one of {sizes}, got {dims}.", param="dimensions")
    return PoolingParams(task="embed", dimensions=dims, normalize=body.normalize)


def encode(value: np.ndarray, encoding_format: str) -> Any:
    """float: a JSON list; base64: the float32 little-endian bytes, as OpenAI sends (and its SDK reads)."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(value, dtype="<f4").tobytes()).decode()
    return value.tolist()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, serving: Serving) -> Response:
    check_task(serving, "embed", "embeddings")
    body.check_supported()
    model = serving.model_name(body.model)
    params = embedding_params(serving, body)
    prompts = render_inputs(serving, body.input, body)
    request_id, values = await pool_all(serving, prompts, params, body, "embd", request)
    data = [
        {"object": "embedding", "index": i, "embedding": encode(value, body.encoding_format)}
        for i, value in enumerate(values)
    ]
    return json_response(envelope(request_id, model, data, prompts))


@router.post("/pooling")
async def pooling(body: PoolingRequest, request: Request, serving: Serving) -> Response:
    """The model's pooled output as it is: an embedding model's vectors (or, with ALL pooling, a vector
    per token), a classifier's class values."""
    info = serving.model_info
    task = body.task or (info.pooling_tasks[0] if info.pooling_tasks else "embed")
    check_task(serving, task, f"the task {task!r}")
    body.check_supported()
    model = serving.model_name(body.model)
    if task in ("classify", "score"):
        for name in ("dimensions", "normalize"):
            if getattr(body, name) is not None:
                raise OpenAIError(f"{name} is for embeddings; task {task!r} takes activation.", param=name)
        params = PoolingParams(task=task, activation=body.activation_of())
    else:
        if body.activation_of() is not None:
            raise OpenAIError(f"activation is for classify and score, not task {task!r}.", param="activation")
        params = msgspec.structs.replace(embedding_params(serving, body), task=task)
    prompts = render_inputs(serving, body.input, body)
    request_id, values = await pool_all(serving, prompts, params, body, "pool", request)
    data = [
        {"object": "pooling", "index": i, "data": encode(value, body.encoding_format)}
        for i, value in enumerate(values)
    ]
    return json_response(envelope(request_id, model, data, prompts))


@router.post("/classify")
async def classify(body: ClassifyRequest, request: Request, serving: Serving) -> Response:
    check_task(serving, "classify", "classification")
    body.check_supported()
    model = serving.model_name(body.model)
    prompts = render_inputs(serving, body.input, body)
    params = PoolingParams(task="classify", activation=body.activation_of())
    request_id, values = await pool_all(serving, prompts, params, body, "classify", request)
    labels = serving.model_info.id2label
    data = []
    for i, value in enumerate(values):
        probs = value.tolist()
        best = int(np.argmax(value))
        data.append(
            {
                "index": i,
                "label": labels.get(str(best), str(best)),
                "probs": probs,
                "num_classes": len(probs),
            }
        )
    return json_response(envelope(request_id, model, data, prompts))
