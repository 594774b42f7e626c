"""The audio doors end to end: `engine serve` of whisper-base (converted from the offline CTranslate2 wheels)
driven by the openai SDK and plain HTTP, on speech that espeak-ng says at test time.

The transcript equals transformers' float32 transcript of the same audio (same features, same language
detection, same suppressed tokens); a 2-minute clip is cut into windows that run as separate engine requests
and come back whole and in order; a client that leaves aborts every window.
"""

from __future__ import annotations

import asyncio
import pathlib
import re
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from tests.serve_helpers import SHARED_API_KEY, Served, serving, wait_until
from tests.speech import espeak_available
from tests.test_serve_e2e import scrape

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not espeak_available(), reason="espeak-ng is not installed"),
]

KEY = "audio-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def words(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


@pytest.fixture(scope="module")
def clips(
    speech: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    """The run's fox and paragraph (conftest.py), and a long clip of the paragraph over and over."""
    folder = tmp_path_factory.mktemp("speech")
    fox, paragraph = speech["fox"], speech["paragraph"]
    samples, rate = soundfile.read(paragraph, dtype="float32")
    pause = np.zeros(rate // 2, dtype=np.float32)
    repeats = -(-120 * rate // (len(samples) + len(pause)))  # at least 2 minutes
    long = np.concatenate([np.concatenate([samples, pause])] * repeats)
    soundfile.write(folder / "long.wav", long, rate)
    return {"fox": fox, "paragraph": paragraph, "long": folder / "long.wav", "repeats": repeats}  # type: ignore[dict-item]


@pytest.fixture(scope="module")
def server(whisper_base: str) -> Any:
    env = {"ENGINE_MAX_AUDIO_CLIP_FILESIZE_MB": "5"}  # a small limit, to see it refuse
    flags = ("--dtype", "float32", "--served-model-name", "whisper", "--api-key", KEY)
    with serving(whisper_base, *flags, env=env) as served:
        yield served


def client(served: Served) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=KEY, max_retries=0)


def metric_total(server: Served, name: str) -> float:
    lines = httpx.get(f"{server.base}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_the_transcript_equals_transformers(server: Served, hf_transcripts: Any, clips: dict) -> None:  # type: ignore[type-arg]
    sdk = client(server)
    inputs, seconds = (
        metric_total(server, "engine:encoder_inputs_total"),
        metric_total(server, "engine:encoder_seconds_total"),
    )
    for name in ("fox", "paragraph"):
        expected = hf_transcripts(clips[name])
        with open(clips[name], "rb") as f:
            answer = sdk.audio.transcriptions.create(model="whisper", file=f)
        assert answer.text == expected, name
        assert answer.usage.type == "duration" and answer.usage.seconds >= 2
    with open(clips["fox"], "rb") as f:
        text = sdk.audio.transcriptions.create(model="whisper", file=f, response_format="text")
    assert "quick brown fox" in words(text)
    # each clip's encoder input is counted, and its time (the engine's counters reach /metrics with its stats)
    wait_until(
        lambda: metric_total(server, "engine:encoder_inputs_total") >= inputs + 3, 30, "the encoder inputs"
    )
    assert metric_total(server, "engine:encoder_seconds_total") > seconds


def hf_timestamped(hf_whisper: Any, path: pathlib.Path) -> list[tuple[float, float, list[int]]]:
    """transformers' generate with return_timestamps: (start, end, text tokens) between its timestamps."""
    import torch

    processor, model = hf_whisper
    samples, rate = soundfile.read(path, dtype="float32")
    features = processor(samples, sampling_rate=rate, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(features, task="transcribe", return_timestamps=True)[0].tolist()
    begin = model.generation_config.no_timestamps_token_id + 1
    marks = [i for i, token_id in enumerate(ids) if token_id >= begin]
    return [
        ((ids[a] - begin) * 0.02, (ids[b] - begin) * 0.02, ids[a + 1 : b])
        for a, b in zip(marks, marks[1:], strict=False)
        if b > a + 1
    ]


def test_segments_equal_transformers_timestamps(server: Served, hf_whisper: Any, clips: dict) -> None:  # type: ignore[type-arg]
    expected = hf_timestamped(hf_whisper, clips["paragraph"])
    with open(clips["paragraph"], "rb") as f:
        verbose = client(server).audio.transcriptions.create(
            model="whisper", file=f, response_format="verbose_json", timestamp_granularities=["segment"]
        )
    ours = [(s.start, s.end, s.tokens) for s in verbose.segments]
    assert len(expected) >= 2 and ours == [(round(a, 3), round(b, 3), t) for a, b, t in expected]


def test_translation_and_subtitles(server: Served, clips: dict) -> None:  # type: ignore[type-arg]
    sdk = client(server)
    with open(clips["fox"], "rb") as f:
        translated = sdk.audio.translations.create(model="whisper", file=f)
    assert "lazy dog" in words(translated.text)
    with open(clips["fox"], "rb") as f:
        srt = sdk.audio.transcriptions.create(model="whisper", file=f, response_format="srt")
    assert re.match(r"1\n00:00:00,000 --> 00:00:0\d,\d{3}\n.*quick brown fox", srt, re.S | re.I)
    with open(clips["fox"], "rb") as f:
        vtt = sdk.audio.transcriptions.create(model="whisper", file=f, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")


def generation_tokens(server: Served) -> float:
    values = scrape({"base": server.base})
    return sum(v for k, v in values.items() if k.startswith("engine:generation_tokens_total"))


def test_a_long_clip_is_cut_whole_and_a_client_that_leaves_aborts_it(server: Served, clips: dict) -> None:  # type: ignore[type-arg]
    before = generation_tokens(server)
    with open(clips["long"], "rb") as f:
        answer = client(server).audio.transcriptions.create(model="whisper", file=f, language="en")
    full_run = generation_tokens(server) - before
    text = words(answer.text)
    assert text.count("morning") >= clips["repeats"] - 1, text  # a sentence cut at a window edge may blur
    assert text.count("coffee") >= clips["repeats"] - 1, text
    # the same clip streamed, left after its first delta: every window's engine request is aborted
    before = generation_tokens(server)
    with httpx.Client(timeout=60, headers=AUTH) as http, open(clips["long"], "rb") as f:
        form = {"model": "whisper", "language": "en", "stream": "true"}
        with http.stream("POST", f"{server.base}/v1/audio/transcriptions", data=form, files={"file": f}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first delta: every window is running

    def running() -> float:
        values = scrape({"base": server.base})
        return sum(v for k, v in values.items() if k.startswith("engine:num_requests_running"))

    wait_until(lambda: running() == 0, 60, "every window's engine request aborted")
    assert generation_tokens(server) - before < full_run / 2, (full_run, generation_tokens(server) - before)


def test_streamed_deltas_make_the_text(server: Served, clips: dict) -> None:  # type: ignore[type-arg]
    sdk = client(server)
    with open(clips["paragraph"], "rb") as f:
        whole = sdk.audio.transcriptions.create(model="whisper", file=f, language="en").text
    with open(clips["paragraph"], "rb") as f:
        stream = sdk.audio.transcriptions.create(
            model="whisper", file=f, language="en", stream=True, extra_body={"stream_include_usage": True}
        )
        events = list(stream)
    chunks = [e for e in events if e.choices]
    assert "".join(c.choices[0]["delta"]["content"] for c in chunks) == whole
    assert chunks[-1].choices[0]["finish_reason"] == "stop" and events[-1].usage["completion_tokens"] > 5
    assert all(e.object == "transcription.chunk" for e in events)


def test_bad_input_gets_a_400_naming_it(server: Served, clips: dict) -> None:  # type: ignore[type-arg]
    url = f"{server.base}/v1/audio/transcriptions"
    fox = pathlib.Path(clips["fox"]).read_bytes()
    cases = [
        ({"file": ("a.wav", b"RIFF not really a wave file")}, {}, "file", "Invalid or unsupported audio file"),
        ({"file": ("a.txt", b"hello")}, {}, "file", "Invalid or unsupported audio file"),
        ({"file": ("a.wav", b"\0" * (6 << 20))}, {}, "file", "ENGINE_MAX_AUDIO_CLIP_FILESIZE_MB"),
        ({"file": ("a.wav", fox)}, {"language": "xx"}, "language", "unsupported language"),
        ({"file": ("a.wav", fox)}, {"n": "2"}, "n", "not supported"),
        ({"file": ("a.wav", fox)}, {"response_format": "verbose_json", "timestamp_granularities[]": "word"},
         "timestamp_granularities", "word"),
        ({"file": ("a.wav", fox)}, {"stream_include_usage": "true"}, "stream_include_usage", "stream"),
        ({"file": ("a.wav", fox)}, {"model": "nope"}, "model", "nope"),
        ({}, {"model": "whisper"}, "file", "required"),
    ]  # fmt: skip
    with httpx.Client(timeout=60, headers=AUTH) as http:
        for files, data, param, message in cases:
            response = http.post(url, files=files or {"x": ("x", b"")}, data=data)
            error = response.json()["error"]
            assert response.status_code in (400, 404) and error["param"] == param, (data, error)
            assert message in error["message"], error
        chat = http.post(f"{server.base}/v1/chat/completions", json={"model": "whisper", "messages": []})
        assert chat.status_code == 404 and "its tasks: transcription" in chat.json()["error"]["message"]


def test_a_text_model_answers_the_audio_doors_with_404(smollm2_server: Served) -> None:
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {SHARED_API_KEY}"}) as http:
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            response = http.post(f"{smollm2_server.base}{path}", files={"file": ("a.wav", b"x")})
            error = response.json()["error"]
            assert response.status_code == 404 and error["code"] == "model_task_not_supported", error
            assert "its tasks: generate" in error["message"]


async def realtime_session(
    served: Served, events: list[dict[str, Any]], wait_for: str, headers: Any = AUTH
) -> list[dict[str, Any]]:  # type: ignore[misc]
    """Send the events, then collect the server's until one of type `wait_for` (after session.created)."""
    import json

    import websockets

    url = served.base.replace("http", "ws", 1) + "/v1/realtime"
    async with websockets.connect(url, additional_headers=headers) as ws:
        received = [json.loads(await ws.recv())]
        for event in events:
            await ws.send(event if isinstance(event, str) else json.dumps(event))
        while received[-1]["type"] != wait_for:
            received.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
    return received


def pcm_events(path: pathlib.Path, seconds: float) -> list[dict[str, Any]]:
    """The clip as base64 PCM16 appends of `seconds` each, a commit after each, then a final commit."""
    import base64

    samples, rate = soundfile.read(path, dtype="int16")
    step = int(seconds * rate)
    events: list[dict[str, Any]] = []
    for start in range(0, len(samples), step):
        audio = base64.b64encode(samples[start : start + step].tobytes()).decode()
        events += [
            {"type": "input_audio_buffer.append", "audio": audio},
            {"type": "input_audio_buffer.commit"},
        ]
    return [*events, {"type": "input_audio_buffer.commit", "final": True}]


def test_realtime_transcribes_a_growing_buffer(server: Served, hf_transcripts: Any, clips: dict) -> None:  # type: ignore[type-arg]
    update = {"type": "session.update", "model": "whisper"}
    events = asyncio.run(
        realtime_session(server, [update, *pcm_events(clips["fox"], 1.0)], "transcription.done")
    )
    assert events[0]["type"] == "session.created" and events[0]["id"].startswith("sess-")
    done = events[-1]
    assert done["text"] == hf_transcripts(clips["fox"])
    assert done["usage"]["completion_tokens"] > 5
    deltas = "".join(e["delta"] for e in events if e["type"] == "transcription.delta")
    assert done["text"].startswith(deltas)  # partials are never taken back (they may lag the final text)
    assert not [e for e in events if e["type"] == "error"], events
    metrics = scrape({"base": server.base})
    assert sum(v for k, v in metrics.items() if k.startswith("engine:websocket_connections_total")) >= 1


def test_realtime_errors_carry_vllms_codes(server: Served) -> None:
    append = {"type": "input_audio_buffer.append", "audio": "AAAA"}
    cases = [
        ({"type": "input_audio_buffer.commit"}, "model_not_validated"),
        ("{not json", "invalid_json"),
        ({"type": "bogus"}, "unknown_event"),
        ({"type": "session.update"}, "invalid_event"),
        ({"type": "session.update", "model": "nope"}, "model_not_found"),
        ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_audio"),
        ({**append, "rate": 8000}, "invalid_event"),
    ]
    for event, code in cases:
        received = asyncio.run(realtime_session(server, [event], "error"))
        assert received[-1]["code"] == code, (event, received)
    import websockets

    with pytest.raises(websockets.exceptions.InvalidStatus, match="403"):
        asyncio.run(realtime_session(server, [], "session.created", headers={}))  # no API key
