"""Real speech for the audio tests, made offline: Debian's espeak-ng speaks the text, PyAV (the `av`
package, which the server already depends on for decoding) resamples espeak's 22050 Hz to Whisper's
16 kHz. Neither sox nor ffmpeg's command line is needed. Also transformers' transcript of a clip, the
audio tests' oracle. Test code, not product code."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import wave
from typing import Any

import numpy as np

RATE = 16000  # what Whisper's feature extractor expects
FOX = "The quick brown fox jumps over the lazy dog."
PARAGRAPH = (
    "Every morning the baker opens his shop at six. He sells fresh bread, small cakes and hot coffee. "
    "The children stop there on their way to school."
)


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def speak(text: str, path: pathlib.Path | str, voice: str = "en", rate: int | None = None) -> pathlib.Path:
    """Writes `text` spoken by espeak-ng `voice` (words per minute `rate`, espeak's 175 when None) to
    `path` as a 16 kHz mono 16-bit wav, and returns the path."""
    import av

    path = pathlib.Path(path)
    raw = path.with_name(f".{path.name}.espeak.wav")
    command = ["espeak-ng", "-v", voice, "-w", str(raw), "--stdin"]  # stdin: text may start with "-"
    if rate is not None:
        command += ["-s", str(rate)]
    try:
        subprocess.run(command, input=text.encode(), check=True, capture_output=True, timeout=60)
        resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        chunks = []
        with av.open(str(raw)) as container:
            for frame in container.decode(audio=0):
                chunks += [out.to_ndarray() for out in resampler.resample(frame)]
        chunks += [out.to_ndarray() for out in resampler.resample(None)]  # flush the resampler's tail
    finally:
        raw.unlink(missing_ok=True)
    with wave.open(os.fspath(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(np.concatenate(chunks, axis=1).astype("<i2").tobytes())
    return path


def hf_transcript(hf_whisper: Any, path: pathlib.Path) -> str:
    """transformers' own: its processor's features, generate() detecting the language, float32.
    hf_whisper: (processor, model), conftest.py's fixture."""
    import soundfile
    import torch

    processor, model = hf_whisper
    samples, rate = soundfile.read(path, dtype="float32")
    assert rate == RATE
    features = processor(samples, sampling_rate=rate, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(features, task="transcribe")
    return str(processor.batch_decode(ids, skip_special_tokens=True)[0])
