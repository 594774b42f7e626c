"""`LLM(whisper).transcribe(audio_files)` and `.translate(...)`: the audio doors' pipeline (frontend/audio/)
offline, every file at once on the engine, results in order."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from frontend.audio.form import AudioRequest
from frontend.audio.formats import all_segments
from frontend.audio.limits import AudioLimits
from frontend.audio.pipeline import AudioRun, prepare, run_all
from frontend.audio.speech_model import SpeechModel
from frontend.engine.async_llm import gather_all
from frontend.offline.pooling import Host
from frontend.server.errors import OpenAIError
from protocol.errors import InvalidParameterError

Audio = str | os.PathLike[str] | bytes  # a file's path, or its bytes


@dataclass
class TranscriptionSegment:
    start: float  # seconds
    end: float
    text: str


@dataclass
class TranscriptionOutput:
    text: str
    language: str | None  # the language the model heard (or was told)
    duration_s: float
    segments: list[TranscriptionSegment] = field(default_factory=list)  # with timestamps=True


class TranscriptionMethods:
    """Mixed into LLM (a speech model's): each method runs its files at once, results in order."""

    def transcribe(
        self: Host, audio: Audio | Sequence[Audio], *, language: str | None = None, prompt: str | None = None,
        temperature: float = 0.0, timestamps: bool = False, max_completion_tokens: int | None = None,
    ) -> list[TranscriptionOutput]:  # fmt: skip
        """Each file's text in its own language; timestamps: with segments placed in time."""
        options = dict(language=language, prompt=prompt, temperature=temperature,
                       max_completion_tokens=max_completion_tokens)  # fmt: skip
        return _run(self, audio, "transcribe", timestamps, options)

    def translate(
        self: Host, audio: Audio | Sequence[Audio], *, language: str | None = None, prompt: str | None = None,
        temperature: float = 0.0, timestamps: bool = False,
    ) -> list[TranscriptionOutput]:  # fmt: skip
        """Each file's speech in English."""
        return _run(
            self,
            audio,
            "translate",
            timestamps,
            dict(language=language, prompt=prompt, temperature=temperature),
        )


def _run(host: Host, audio: Audio | Sequence[Audio], task: str, timestamps: bool, options: dict[str, Any]) -> list[TranscriptionOutput]:  # fmt: skip
    if host.model_info.runner != "transcription":
        raise InvalidParameterError(
            "model", f"{host.model} does not transcribe; its runner is {host.model_info.runner}"
        )
    speech = SpeechModel.load(host.model, host._require_tokenizer(), host.model_info.encoder_len)
    files = [audio] if isinstance(audio, (str, bytes, os.PathLike)) else list(audio)
    bodies = [AudioRequest(file=_read(one), filename="audio", task=task,
                           response_format="verbose_json" if timestamps else "json", **options) for one in files]  # fmt: skip
    limits = AudioLimits.from_env(os.environ)

    async def one(body: AudioRequest) -> AudioRun:
        try:
            run = await prepare(host.engine_llm, speech, body, f"transcribe-{next(host._counter)}", limits,
                                host.model_info.max_model_len)  # fmt: skip
        except OpenAIError as error:  # the door's 400: the offline API's typed error
            raise InvalidParameterError(error.param or "audio", error.message) from None
        return await run_all(host.engine_llm, speech, run)

    runs = host.run(gather_all([one(body) for body in bodies]))
    return [
        TranscriptionOutput(
            run.text,
            run.language,
            run.duration_s,
            [TranscriptionSegment(s.start_s, s.end_s, s.text) for s in all_segments(run, speech)]
            if timestamps
            else [],
        )
        for run in runs
    ]


def _read(audio: Audio) -> bytes:
    if isinstance(audio, bytes):
        return audio
    with open(audio, "rb") as f:
        return f.read()
