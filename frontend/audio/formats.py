"""An audio answer's shapes: json, text, verbose_json (with segments), srt and vtt subtitles.

Segments are the windows the audio was cut into (at most 30 s each, cut in the quietest 100 ms before each
boundary): the model runs without timestamp tokens, so a window's text is placed over the window's span.
"""

from __future__ import annotations

import math
from typing import Any

from frontend.audio.pipeline import AudioRun, Window


def duration_usage(run: AudioRun) -> dict[str, Any]:
    """OpenAI's usage of a whisper-1 answer: the audio's seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(run.duration_s)}


def json_body(run: AudioRun) -> dict[str, Any]:
    return {"text": run.text, "usage": duration_usage(run)}


def _segment(window: Window, run: AudioRun) -> dict[str, Any]:
    return {
        "id": window.index,
        "seek": round(window.start_s * 100),  # in 10 ms frames, as OpenAI's
        "start": round(window.start_s, 3),
        "end": round(window.end_s, 3),
        "text": window.text,
        "tokens": [],
        "temperature": run.params.temperature,
        "avg_logprob": None,
        "compression_ratio": None,
        "no_speech_prob": None,
    }


def verbose_body(run: AudioRun) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task": run.body.task,
        "language": run.language or "en",
        "duration": round(run.duration_s, 3),
        "text": run.text,
        "segments": [_segment(window, run) for window in run.windows],
        "usage": duration_usage(run),
    }
    return body


def _clock(seconds: float, separator: str) -> str:
    milliseconds = round(seconds * 1000)
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{separator}{fraction:03d}"


def srt_text(run: AudioRun) -> str:
    cues = [
        f"{n}\n{_clock(w.start_s, ',')} --> {_clock(w.end_s, ',')}\n{w.text.strip()}\n"
        for n, w in enumerate((w for w in run.windows if w.text.strip()), start=1)
    ]
    return "\n".join(cues)


def vtt_text(run: AudioRun) -> str:
    cues = [
        f"{_clock(w.start_s, '.')} --> {_clock(w.end_s, '.')}\n{w.text.strip()}\n"
        for w in run.windows
        if w.text.strip()
    ]
    return "WEBVTT\n\n" + "\n".join(cues)
