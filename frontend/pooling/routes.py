"""Which doors an API server opens: a generative model's, a pooling model's or a speech model's (vLLM
registers routes by what the model supports). The other runners' paths answer 404 with a message naming
the model's tasks, not FastAPI's bare "Not Found"."""

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


AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
RUNNER_PATHS = {"generate": GENERATE_PATHS, "pooling": POOLING_PATHS, "transcription": AUDIO_PATHS}
WHAT = {
    "generate": "is a generative model",
    "pooling": "generates no text",
    "transcription": "is a speech-to-text model",
}


def model_tasks(info: ModelInfo) -> list[str]:
    """What the model does: a pooling model's tasks, or its runner's one."""
    return list(info.pooling_tasks) if info.runner == "pooling" else [info.runner]


def absent_router(info: ModelInfo) -> APIRouter:
    """POST on the other runners' paths: 404 naming what the model does."""
    paths = [path for runner, paths in RUNNER_PATHS.items() if runner != info.runner for path in paths]
    tasks = ", ".join(model_tasks(info))
    router = APIRouter()

    async def absent(request: Request) -> Any:
        what = WHAT.get(info.runner, "does not serve this route")
        raise OpenAIError(
            f"The model `{info.served_model_names[0]}` {what}: it does not serve {request.url.path}; "
            f"its tasks: {tasks}.",
            status=404,
            type="NotFoundError",
            param="model",
            code="model_task_not_supported",
        )

    for path in paths:
        router.add_api_route(path, absent, methods=["POST"], include_in_schema=False)
    return router
