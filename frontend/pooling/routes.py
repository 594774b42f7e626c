"""Which doors an API server opens: a generative model's, or a pooling model's (vLLM registers routes by
what the model supports). The other runner's paths answer 404 with a message naming the model's tasks,
not FastAPI's bare "Not Found"."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from frontend.server.errors import OpenAIError
from protocol.messages import ModelInfo

GENERATE_PATHS = (
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/invocations",
)
POOLING_PATHS = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)


def absent_router(info: ModelInfo) -> APIRouter:
    """POST on the other runner's paths: 404 naming what the model does."""
    pooling = info.runner == "pooling"
    paths = GENERATE_PATHS if pooling else POOLING_PATHS
    tasks = ", ".join(info.pooling_tasks) if pooling else "generate"
    router = APIRouter()

    async def absent(request: Request) -> Any:
        what = "generates no text" if pooling else "is a generative model: it serves no pooling route"
        raise OpenAIError(
            f"The model `{info.served_model_names[0]}` {what} ({request.url.path}); its tasks: {tasks}.",
            status=404,
            type="NotFoundError",
            param="model",
            code="model_task_not_supported",
        )

    for path in paths:
        router.add_api_route(path, absent, methods=["POST"], include_in_schema=False)
    return router
