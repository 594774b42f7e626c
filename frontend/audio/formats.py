"""An audio answer's shapes: json, text, verbose_json (with segments), srt and vtt subtitles.

Segments come from the model's timestamp tokens (the answer ran with them, frontend/audio/speech_model.py):
the text between two timestamps is one segment, placed at the window's start plus 0.02 s a step, as vLLM's
verbose_json places them. Text after the last timestamp ends at the window's end.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

from frontend.audio.pipeline import AudioRun, Segment, segments_of
from frontend.audio.speech_model import SpeechModel


def all_segments(run: AudioRun, speech: SpeechModel) -> list[Segment]:
    return [segment for window in run.windows for segment in segments_of(window, speech)]


def duration_usage(run: AudioRun) -> dict[str, Any]:
    """OpenAI's usage of a whisper-1 answer: the audio's seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(run.duration_s)}


def json_body(run: AudioRun) -> dict[str, Any]:
    return {"text": run.text, "usage": duration_usage(run)}


def _segment(index: int, segment: Segment, run: AudioRun) -> dict[str, Any]:
    encoded = segment.text.encode()
    return {
        "id": index,
        "seek": int(segment.start_s),  # as vLLM's
        "start": round(segment.start_s, 3),
        "end": round(segment.end_s, 3),
        "text": segment.text,
        "tokens": segment.token_ids,
        "temperature": run.params.temperature,
        "avg_logprob": sum(segment.logprobs) / max(len(segment.logprobs), 1),
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
        "no_speech_prob": None,  # (Whisper's no-speech token is not read)
    }


def verbose_body(run: AudioRun, speech: SpeechModel) -> dict[str, Any]:
    segments = all_segments(run, speech)
    return {
        "task": run.body.task,
        "language": run.language or "en",
        "duration": round(run.duration_s, 3),
        "text": run.text,
        "segments": [_segment(i, segment, run) for i, segment in enumerate(segments)],
        "usage": duration_usage(run),
    }


def _clock(seconds: float, separator: str) -> str:
    milliseconds = round(seconds * 1000)
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{separator}{fraction:03d}"


def srt_text(run: AudioRun, speech: SpeechModel) -> str:
    shown = [segment for segment in all_segments(run, speech) if segment.text.strip()]
    cues = [
        f"{n}\n{_clock(s.start_s, ',')} --> {_clock(s.end_s, ',')}\n{s.text.strip()}\n"
        for n, s in enumerate(shown, start=1)
    ]
    return "\n".join(cues)


def vtt_text(run: AudioRun, speech: SpeechModel) -> str:
    cues = [
        f"{_clock(s.start_s, '.')} --> {_clock(s.end_s, '.')}\n{s.text.strip()}\n"
        for s in all_segments(run, speech)
        if s.text.strip()
    ]
    return "WEBVTT\n\n" + "\n".join(cues)
