"""The error shapes of the HTTP edge: OpenAI's {"error": {message, type, param, code}} (Anthropic's
{"type": "error", "error": {type, message}} on its doors), and the map from every typed error (ours and
the engine's) to them."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi.responses import Response

from protocol.errors import EngineDeadError, InvalidParameterError, RequestAbortedError

logger = logging.getLogger("engine.api")


class OpenAIError(Exception):
    """An error the HTTP edge turns into {"error": {message, type, param, code}} with `status`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)  # the doors that answer in Anthropic's shape


def anthropic_error_body(error: OpenAIError) -> dict[str, Any]:
    """Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: OpenAIError, path: str = "") -> Response:
    """The error in the shape of the door `path` belongs to: Anthropic's for its doors, else OpenAI's."""
    anthropic = path.startswith(ANTHROPIC_PATHS)
    return Response(
        msgspec.json.encode(anthropic_error_body(error) if anthropic else error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


def to_openai_error(error: BaseException) -> OpenAIError:
    """Any error met while serving a request, as the OpenAI error a client should see."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return OpenAIError(
            f"The engine is not available: {error}",
            status=503,
            type="service_unavailable_error",
            code="engine_dead",
        )
    if isinstance(error, InvalidParameterError):
        if error.code == "model_not_found":
            return OpenAIError(
                error.message, status=404, type="NotFoundError", param=error.param, code=error.code
            )
        if error.code in ("engine_paused", "engine_sleeping"):
            return OpenAIError(error.message, status=503, type="service_unavailable_error", code=error.code)
        return OpenAIError(error.message, param=error.param)
    if isinstance(error, RequestAbortedError):
        return OpenAIError(
            f"The request was aborted: {error}", status=503, type="service_unavailable_error", code="aborted"
        )
    logger.error("internal error while serving a request", exc_info=error)
    return OpenAIError(f"Internal error: {type(error).__name__}: {error}", status=500, type="internal_error")


def http_status_error(status: int, detail: Any) -> OpenAIError:
    """Starlette's own errors (an unparsable body, an unknown path, a wrong method) in OpenAI's shape."""
    kinds = {404: "NotFoundError", 405: "invalid_request_error", 401: "authentication_error"}
    message = detail if isinstance(detail, str) else msgspec.json.encode(detail).decode()
    if status == 400 and "parsing the body" in message:
        message = "The request body is not valid JSON (or not UTF-8)."
    return OpenAIError(message, status=status, type=kinds.get(status, "invalid_request_error"))
