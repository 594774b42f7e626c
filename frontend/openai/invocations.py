"""POST /invocations: SageMaker's one inference route (with GET/POST /ping, server/admin.py). As vLLM
does, the body's shape picks the door: `messages` is a chat completion, `prompt` a completion; the
answer is that door's, JSON or SSE, errors included."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from frontend.openai import chat, completions
from frontend.openai.common import Serving
from frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from frontend.server.errors import OpenAIError

router = APIRouter()


@router.post("/invocations")
async def invocations(request: Request, serving: Serving) -> Response:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError("The request body is not valid JSON.", param=None) from None
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.", param=None)
    try:
        if "messages" in body:
            return await chat.chat_completions(ChatCompletionRequest.model_validate(body), request, serving)
        if "prompt" in body:
            return await completions.completions(CompletionRequest.model_validate(body), request, serving)
    except ValidationError as error:  # the door's own 400, as if the body had been sent to it
        raise RequestValidationError(error.errors()) from None
    raise OpenAIError(
        "Cannot tell which API the body is for: give `messages` (a chat completion) or `prompt` "
        "(a completion).",
        param=None,
    )
