"""The audio doors' multipart form, as OpenAI's SDK and vLLM's server send it, read into one checked request.

Every field the doors implement is read here; any other field is a 400 naming it (nothing accepted and
ignored). Array fields come as `name[]` (the SDK's spelling) or `name`, repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.server.errors import OpenAIError

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# the fields the doors read, by kind (`language` names the spoken language on both doors, as in vLLM;
# `to_language` the output's, English only)
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
INT_FIELDS = ("top_k", "seed", "max_completion_tokens")
BOOL_FIELDS = ("stream", "stream_include_usage", "stream_continuous_usage_stats")
TEXT_FIELDS = ("model", "language", "prompt", "response_format", "to_language", "request_id")
LIST_FIELDS = ("timestamp_granularities",)


@dataclass
class AudioRequest:
    file: bytes
    filename: str
    task: str  # "transcribe" or "translate"
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    to_language: str | None = None
    request_id: str | None = None
    temperature: float = 0.0
    top_p: float | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_include_usage: bool = False
    stream_continuous_usage_stats: bool = False
    timestamp_granularities: list[str] = field(default_factory=list)

    @property
    def timestamps(self) -> bool:
        """Whether the answer places its text in time (segments, subtitles): the model emits timestamps."""
        return self.response_format in ("verbose_json", "srt", "vtt")


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(message, param=param)


async def read_form(request: Any, task: str, max_file_bytes: int) -> AudioRequest:
    """The request's multipart form -> an AudioRequest; OpenAIError (400) naming the first bad field."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise invalid("file", "the audio doors take multipart/form-data with the audio in `file`.")
    try:
        form = await request.form(max_files=1, max_fields=64)
    except Exception as error:  # noqa: BLE001 (python-multipart's and Starlette's parse errors)
        raise invalid("file", f"the multipart body could not be read: {error}") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise invalid("file", "`file` is required: the audio to transcribe, as a file part.")
    data = await upload.read(max_file_bytes + 1)
    await form.close()
    values: dict[str, Any] = {}
    for raw_key, value in form.multi_items():
        key = raw_key.removesuffix("[]")
        if key == "file":
            continue
        if not isinstance(value, str):
            raise invalid(key, f"`{key}` must be a text field, not a file.")
        if key in LIST_FIELDS:
            values.setdefault(key, []).append(value)
        elif key in values:
            raise invalid(key, f"`{key}` is given twice.")
        else:
            values[key] = _parse(key, value)
    body = AudioRequest(file=data, filename=upload.filename or "audio", task=task, **values)
    _check(body, task)
    return body


def _parse(key: str, value: str) -> Any:
    try:
        if key in FLOAT_FIELDS:
            return float(value)
        if key in INT_FIELDS:
            return int(value)
    except ValueError:
        raise invalid(key, f"`{key}` must be a number, got {value!r}.") from None
    if key in BOOL_FIELDS:
        if value.lower() not in ("true", "false", "1", "0"):
            raise invalid(key, f"`{key}` must be true or false, got {value!r}.")
        return value.lower() in ("true", "1")
    if key in TEXT_FIELDS:
        return value
    raise invalid(key, f"`{key}` is not supported by this server.")


def _check(body: AudioRequest, task: str) -> None:
    if body.response_format not in RESPONSE_FORMATS:
        raise invalid("response_format", f"response_format must be one of {', '.join(RESPONSE_FORMATS)}.")
    for granularity in body.timestamp_granularities:
        if granularity == "word":
            raise invalid("timestamp_granularities", "word timestamps are not supported; `segment` is.")
        if granularity != "segment":
            raise invalid("timestamp_granularities", f"unknown granularity {granularity!r}: use `segment`.")
    if body.timestamp_granularities and body.response_format != "verbose_json":
        raise invalid(
            "timestamp_granularities", "timestamp_granularities needs response_format verbose_json."
        )
    if body.stream and body.response_format not in ("json", "text"):
        raise invalid("stream", f"a streamed answer is text deltas: response_format {body.response_format} "
                      "is not streamed.")  # fmt: skip
    if not body.stream and (body.stream_include_usage or body.stream_continuous_usage_stats):
        given = "stream_include_usage" if body.stream_include_usage else "stream_continuous_usage_stats"
        raise invalid(given, f"`{given}` needs stream=true.")
    if body.to_language is not None and (task != "translate" or body.to_language != "en"):
        raise invalid(
            "to_language", "Whisper translates into English only: to_language `en`, on translations."
        )
    if not 0.0 <= body.temperature <= 1.0:
        raise invalid("temperature", f"temperature must be in [0, 1], got {body.temperature}.")
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
        raise invalid("max_completion_tokens", "max_completion_tokens must be at least 1.")
