"""Speech without a server: `LLM(whisper).transcribe(...)` and `engine run-batch` lines for the audio doors
(`file` a path or a data URL), on whisper-base and espeak-ng speech; their texts equal transformers'."""

from __future__ import annotations

import base64
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from tests.speech import espeak_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not espeak_available(), reason="espeak-ng is not installed"),
]


@pytest.fixture(scope="module")
def clips(speech: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    return speech  # the run's fox and paragraph (conftest.py)


def test_llm_transcribes_a_list_of_files(
    whisper_base: str, hf_transcripts: Any, clips: dict[str, pathlib.Path]
) -> None:
    from frontend.offline.llm import LLM
    from protocol.errors import InvalidParameterError

    expected = {name: hf_transcripts(path) for name, path in clips.items()}
    with LLM(whisper_base, dtype="float32") as llm:
        fox, paragraph = llm.transcribe([clips["fox"].read_bytes(), str(clips["paragraph"])])  # bytes, a path
        assert (fox.text, paragraph.text) == (expected["fox"], expected["paragraph"])
        assert fox.language == "en" and 2.0 < fox.duration_s < 5.0
        (timed,) = llm.transcribe(clips["paragraph"], timestamps=True)
        assert len(timed.segments) >= 2 and "".join(s.text for s in timed.segments) == timed.text
        assert all(a.end <= b.start for a, b in zip(timed.segments, timed.segments[1:], strict=False))
        assert "lazy dog" in llm.translate(clips["fox"], language="en")[0].text.lower()
        with pytest.raises(InvalidParameterError, match="Invalid or unsupported audio file"):
            llm.transcribe(b"not audio")


def test_run_batch_answers_audio_lines(
    whisper_base: str, hf_transcripts: Any, clips: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    data_url = "data:audio/wav;base64," + base64.b64encode(clips["fox"].read_bytes()).decode()
    bodies: list[tuple[str, str, dict[str, Any]]] = [
        ("path", "/v1/audio/transcriptions", {"file": str(clips["paragraph"]), "model": whisper_base}),
        ("data-url", "/v1/audio/transcriptions", {"file": data_url, "response_format": "verbose_json"}),
        ("translate", "/v1/audio/translations", {"file": str(clips["fox"])}),
        ("text", "/v1/audio/transcriptions", {"file": data_url, "response_format": "text", "language": "en"}),
        ("missing", "/v1/audio/transcriptions", {"file": str(tmp_path / "nope.wav")}),
        ("bad-field", "/v1/audio/transcriptions", {"file": data_url, "n": 2}),
    ]
    lines = [
        json.dumps({"custom_id": c, "method": "POST", "url": url, "body": body}) for c, url, body in bodies
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "frontend.cli", "run-batch", whisper_base, "--dtype", "float32",
               "-i", str(source), "-o", str(target)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert records["path"]["response"]["body"]["text"] == hf_transcripts(clips["paragraph"])
    verbose = records["data-url"]["response"]["body"]
    assert verbose["segments"] and "quick brown fox" in verbose["text"].lower()
    assert "lazy dog" in records["translate"]["response"]["body"]["text"].lower()
    assert "quick brown fox" in records["text"]["response"]["body"].lower()  # a plain-text body
    assert records["missing"]["response"] is None and records["missing"]["error"]["param"] == "body.file"
    assert records["bad-field"]["response"]["status_code"] == 400
    assert records["bad-field"]["error"]["param"] == "n"
