"""The lines of a batch file: OpenAI's batch input (custom_id, method, url, body) checked before any
door sees it, and the output records (OpenAI's batch output format).

An answered line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}, where
body is the door's JSON body, and error is null on a 2xx, else the door's error object. A line that never
reached a door (not JSON, no custom_id, not POST, an unknown url, a streamed body, a repeated custom_id):
"response" null and "error" in the same shape as a door's, {"message", "type", "param", "code"}.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.batch.audio_lines import AUDIO_DOORS, AudioLineError, multipart_body

# url -> what it serves; a line's url must be one of them
DOORS = {
    "/v1/chat/completions": "chat completions",
    "/v1/completions": "completions",
    "/v1/responses": "the Responses API",
    # a pooling model's (docs/embeddings.md); a line for the other kind of model gets that door's 404
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/classify": "classification",
    "/score": "scores",
    "/v1/score": "scores",
    "/rerank": "reranking",
    "/v1/rerank": "reranking",
    "/v2/rerank": "reranking",
    **AUDIO_DOORS,  # a speech model's: `file` a path or a data URL (frontend/batch/audio_lines.py)
}
# OpenAI batch urls this server does not serve yet
NOT_YET = {"/v1/moderations": "moderations"}


@dataclass
class BatchLine:
    custom_id: str
    url: str
    body: bytes  # the request body as JSON (an audio door's: its multipart form), what the door receives
    content_type: str = "application/json"


class LineError(Exception):
    """A line that goes to no door; its output record says why."""

    def __init__(
        self, message: str, code: str, param: str | None = None, custom_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.custom_id = message, code, param, custom_id

    def error(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }


def parse_line(text: str, number: int) -> BatchLine:
    """A batch-file line (its 1-based number, for messages) -> the request it holds, or LineError."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as error:
        raise LineError(f"line {number} is not valid JSON: {error}", "invalid_json") from None
    if not isinstance(line, dict):
        raise LineError(f"line {number} is not a JSON object", "invalid_line")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(
            f"line {number}: custom_id must be a non-empty string", "invalid_custom_id", "custom_id"
        )

    def fail(message: str, code: str, param: str) -> LineError:
        return LineError(f"line {number}: {message}", code, param, custom_id)

    method = line.get("method")
    if not isinstance(method, str) or method.upper() != "POST":
        raise fail(f"method must be POST, got {method!r}", "invalid_method", "method")
    url = line.get("url")
    if url in NOT_YET:
        raise fail(f"{NOT_YET[url]} ({url}) are not supported by this server yet", "unsupported_url", "url")
    if not isinstance(url, str) or url not in DOORS:
        raise fail(f"url must be one of {', '.join(DOORS)}; got {url!r}", "invalid_url", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise fail("body must be a JSON object (the request's body)", "invalid_body", "body")
    if body.get("stream"):
        raise fail("stream is not supported in a batch file", "unsupported_field", "body.stream")
    if url in AUDIO_DOORS:
        try:
            content_type, form = multipart_body(body)
        except AudioLineError as error:
            raise fail(str(error), "invalid_file", "body.file") from None
        return BatchLine(custom_id, url, form, content_type)
    return BatchLine(custom_id, url, msgspec.json.encode(body))


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def answered(custom_id: str, status: int, request_id: str, raw_body: bytes) -> dict[str, Any]:
    """The record of a line a door answered (any status: a 400 is the door's answer, in its own shape)."""
    try:
        body: Any = json.loads(raw_body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = raw_body.decode("utf-8", "replace")
    error = None
    if not 200 <= status < 300:
        inner = body.get("error") if isinstance(body, dict) else None
        error = (
            inner
            if isinstance(inner, dict)
            else {"message": str(body), "type": None, "param": None, "code": None}
        )
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def failed(custom_id: str | None, error: dict[str, Any]) -> dict[str, Any]:
    """The record of a line no door answered."""
    return {"id": _record_id(), "custom_id": custom_id, "response": None, "error": error}
