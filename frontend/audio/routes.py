"""POST /v1/audio/transcriptions and /v1/audio/translations: an audio upload -> Whisper -> text (json, text,
verbose_json, srt, vtt) or an SSE stream of vLLM's `transcription.chunk` deltas.

A server of a speech model opens these doors alone (frontend/server/app.py); a corrupt or unsupported
file is a 400 "Invalid or unsupported audio file", a file over the size limit a 400 naming the limit.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from frontend.audio.form import AudioRequest, read_form
from frontend.audio.formats import json_body, srt_text, verbose_body, vtt_text
from frontend.audio.pipeline import AudioRun, prepare, run_all, stream_texts
from frontend.engine.async_llm import new_request_id
from frontend.openai.common import Serving, header_safe, json_response, until_disconnected
from frontend.openai.format import SSE_DONE, sse, usage
from frontend.server.errors import to_openai_error

router = APIRouter()


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, serving: Serving) -> Response:
    return await _serve(request, serving, "transcribe")


@router.post("/v1/audio/translations")
async def translations(request: Request, serving: Serving) -> Response:
    return await _serve(request, serving, "translate")


async def _serve(request: Request, serving: Any, task: str) -> Response:
    serving.admit()
    speech = serving.speech
    assert speech is not None  # the doors open on a speech model's server alone
    body = await read_form(request, task, serving.audio_limits.max_file_bytes)
    await serving.check_model(body.model)
    model = serving.model_name(body.model)
    request_id = new_request_id("trsc" if task == "transcribe" else "trsl")
    limits, max_model_len = serving.audio_limits, serving.model_info.max_model_len
    run = await until_disconnected(
        request, prepare(serving.llm, speech, body, request_id, limits, max_model_len)
    )
    headers = {"X-Request-Id": body.request_id} if body.request_id and header_safe(body.request_id) else None
    if body.stream:
        chunks = _stream(serving, run, model, int(time.time()))
        return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
    run = await until_disconnected(request, run_all(serving.llm, speech, run))
    return _answer(run, body, speech, headers)


def _answer(run: AudioRun, body: AudioRequest, speech: Any, headers: dict[str, str] | None) -> Response:
    if body.response_format == "text":
        return PlainTextResponse(run.text, headers=headers)
    if body.response_format == "srt":
        return PlainTextResponse(srt_text(run, speech), headers=headers)
    if body.response_format == "vtt":
        return PlainTextResponse(vtt_text(run, speech), media_type="text/vtt", headers=headers)
    if body.response_format == "verbose_json":
        return json_response(verbose_body(run, speech), headers)
    return json_response(json_body(run), headers)


async def _stream(serving: Any, run: AudioRun, model: str, created: int) -> AsyncIterator[bytes]:
    """vLLM's stream: a `transcription.chunk` per delta, the last with its finish reason, then (asked
    for) one with usage and no choices, then [DONE]."""
    body = run.body
    envelope = {"id": run.request_id, "object": "transcription.chunk", "created": created, "model": model}

    def totals() -> dict[str, Any]:
        return usage(run.num_prompt_tokens, run.num_output_tokens, 0)

    def chunk(content: str, finish_reason: str | None) -> bytes:
        choice = {"delta": {"content": content}, "finish_reason": finish_reason, "stop_reason": None}
        extra = {"usage": totals()} if body.stream_continuous_usage_stats else {}
        return sse({**envelope, "choices": [choice], **extra})

    try:
        async for _, text in stream_texts(serving.llm, run):
            yield chunk(text, None)
    except Exception as error:
        yield sse(to_openai_error(error).body())
        yield SSE_DONE
        return
    yield chunk("", run.windows[-1].finish_reason or "stop")
    if body.stream_include_usage:
        yield sse({**envelope, "choices": [], "usage": totals()})
    yield SSE_DONE
