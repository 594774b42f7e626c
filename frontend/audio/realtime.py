"""WS /v1/realtime: vLLM's realtime transcription protocol, served by Whisper.

Client events: `session.update` {model}, `input_audio_buffer.append` {audio: base64 PCM16, 16 kHz mono},
`input_audio_buffer.commit` {final}. Server events: `session.created` {id, created}, `transcription.delta`
{delta}, `transcription.done` {text, usage}, `error` {error, code} with vLLM's codes.

Whisper is not streaming-native: it reads a whole window (up to 30 s, padded) and writes its text. So a
partial transcript is a fresh transcription of the whole buffer at each commit, and only the text two such
hypotheses in a row agree on (their common prefix, cut back to a word's end) is sent as a delta; it is never
taken back. The final commit transcribes the buffer once more and sends what is left, then `done` with the
whole text (the authority, should the last pass disagree with what went out). The cost: each commit runs
the encoder over a full window and decodes the buffer's text again, so a commit every second over a 20 s
utterance decodes about 20 times the tokens of one transcription (measured in docs/audio.md). A commit
that arrives while a pass runs is folded into the next one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from frontend.audio.form import AudioRequest
from frontend.audio.pipeline import AudioRun, prepare_samples, run_all
from frontend.audio.speech_model import SAMPLE_RATE
from frontend.openai.format import usage
from frontend.server.errors import OpenAIError

router = APIRouter()
EVENT_FIELDS = {
    "session.update": {"model"},
    "input_audio_buffer.append": {"audio"},
    "input_audio_buffer.commit": {"final"},
}


class RealtimeError(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def stable_prefix(previous: str, current: str) -> str:
    """What two hypotheses agree on, up to the last whole word both have."""
    n = 0
    while n < min(len(previous), len(current)) and previous[n] == current[n]:
        n += 1
    if n == len(previous) == len(current):
        return current
    cut = current.rfind(" ", 0, n + 1)  # a word is whole when a space follows it in both
    return current[: max(cut, 0)]


class RealtimeSession:
    def __init__(self, websocket: WebSocket, serving: Any) -> None:
        self.websocket, self.serving = websocket, serving
        self.model: str | None = None  # set by a valid session.update
        self.chunks: list[np.ndarray] = []
        self.num_samples = 0
        self.sent = ""  # text sent as deltas for the current utterance
        self.hypothesis = ""  # the last pass's text
        self.language: str | None = None  # detected on the utterance's first pass
        self.pass_task: asyncio.Task[None] | None = None
        self.pending: bool | None = None  # a commit waiting for the running pass (its `final`)

    async def run(self) -> None:
        await self.send(
            {"type": "session.created", "id": f"sess-{uuid.uuid4().hex}", "created": int(time.time())}
        )
        while True:
            text = await self.websocket.receive_text()
            try:
                await self.handle(text)
            except RealtimeError as error:
                await self.send({"type": "error", "error": error.message, "code": error.code})

    async def handle(self, text: str) -> None:
        try:
            event = json.loads(text)
        except json.JSONDecodeError:
            raise RealtimeError("Invalid JSON", "invalid_json") from None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind not in EVENT_FIELDS:
            raise RealtimeError(f"Unknown event type: {kind}", "unknown_event")
        extra = set(event) - EVENT_FIELDS[kind] - {"type", "event_id"}
        if extra:
            raise RealtimeError(f"{kind} does not take {', '.join(sorted(extra))}", "invalid_event")
        if kind == "session.update":
            await self.update(event.get("model"))
        elif kind == "input_audio_buffer.append":
            self.append(event.get("audio"))
        else:
            self.commit(bool(event.get("final", False)))

    async def update(self, model: Any) -> None:
        if not isinstance(model, str) or not model:
            raise RealtimeError("Missing required field: model", "invalid_event")
        try:
            await self.serving.check_model(model)
        except OpenAIError:
            raise RealtimeError(f"The model `{model}` does not exist.", "model_not_found") from None
        self.model = self.serving.model_name(model)

    def append(self, audio: Any) -> None:
        try:
            data = base64.b64decode(audio, validate=True) if isinstance(audio, str) else b""
        except (binascii.Error, ValueError):
            data = b""
        if not data or len(data) % 2:
            raise RealtimeError("Invalid audio data", "invalid_audio")
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
        if (self.num_samples + len(samples)) / SAMPLE_RATE > self.serving.audio_limits.max_duration_s:
            raise RealtimeError("Invalid audio data: the buffer is past the duration limit", "invalid_audio")
        self.chunks.append(samples)
        self.num_samples += len(samples)

    def commit(self, final: bool) -> None:
        if self.model is None:
            raise RealtimeError(
                "Model not validated. Make sure to validate the model by sending a session.update event.",
                "model_not_validated",
            )
        if self.pass_task is not None and not self.pass_task.done():
            self.pending = final or bool(self.pending)
            return
        self.pass_task = asyncio.create_task(self.transcribe(final))

    async def transcribe(self, final: bool) -> None:
        while True:
            try:
                await self.one_pass(final)
            except Exception as error:  # noqa: BLE001 (this pass's failure, told to the client)
                message = (
                    error.message if isinstance(error, OpenAIError) else f"{type(error).__name__}: {error}"
                )
                await self.send({"type": "error", "error": message, "code": "processing_error"})
            if self.pending is None:
                return
            final, self.pending = self.pending, None

    async def one_pass(self, final: bool) -> None:
        samples = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)
        run: AudioRun | None = None
        if len(samples):
            serving, speech = self.serving, self.serving.speech
            body = AudioRequest(file=b"", filename="realtime", task="transcribe", language=self.language)
            run = await prepare_samples(serving.llm, speech, body, f"rt-ws-{uuid.uuid4().hex}", samples,
                                        serving.model_info.max_model_len)  # fmt: skip
            self.language = run.language
            run = await run_all(serving.llm, speech, run)
        text = run.text if run is not None else ""
        agreed = text if final else stable_prefix(self.hypothesis, text)
        if len(agreed) > len(self.sent) and agreed.startswith(self.sent):
            await self.send({"type": "transcription.delta", "delta": agreed[len(self.sent) :]})
            self.sent = agreed
        self.hypothesis = text
        if final:
            tokens = (
                usage(run.num_prompt_tokens, run.num_output_tokens, 0) if run is not None else usage(0, 0, 0)
            )
            await self.send({"type": "transcription.done", "text": text, "usage": tokens})
            self.chunks, self.num_samples, self.sent, self.hypothesis, self.language = [], 0, "", "", None

    async def send(self, event: dict[str, Any]) -> None:
        await self.websocket.send_text(json.dumps(event))

    async def close(self) -> None:
        if self.pass_task is not None and not self.pass_task.done():
            self.pass_task.cancel()  # its generations' cleanup aborts their engine requests
            await asyncio.gather(self.pass_task, return_exceptions=True)


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket) -> None:
    deps = websocket.app.state.deps
    if deps.config.api_keys and not authorized(websocket, deps.config.api_keys):
        await websocket.close(code=1008, reason="Unauthorized")  # before the handshake: a 403
        return
    await websocket.accept()
    metrics, name = deps.metrics, deps.serving.model_info.served_model_names[0]
    started = time.monotonic()
    if metrics is not None:
        metrics.websocket_total.labels(name).inc()
        metrics.websocket_active.labels(name).inc()
    session = RealtimeSession(websocket, deps.serving)
    try:
        await session.run()
    except WebSocketDisconnect:
        pass
    finally:
        await session.close()
        if metrics is not None:
            metrics.websocket_active.labels(name).dec()
            metrics.websocket_duration.labels(name).observe(time.monotonic() - started)


def authorized(websocket: WebSocket, keys: list[str]) -> bool:
    """`Authorization: Bearer KEY` (vLLM's) or `x-api-key: KEY`, compared in constant time."""
    bearer = websocket.headers.get("authorization", "")
    offered = [bearer[7:] if bearer[:7].lower() == "bearer " else "", websocket.headers.get("x-api-key", "")]
    return any(hmac.compare_digest(given.encode(), key.encode()) for given in offered for key in keys)
