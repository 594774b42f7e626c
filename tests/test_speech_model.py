"""Whisper's decoder prompts (frontend/audio/speech_model.py), multilingual and English-only, with the ids
of whisper-base's vocabulary."""

from __future__ import annotations

from types import SimpleNamespace

from frontend.audio.speech_model import SpeechModel

SOT, PREV, NO_TIMESTAMPS, EOT = 50258, 50361, 50363, 50257
TOKENIZER = SimpleNamespace(
    encode=lambda text, add_special_tokens=False: [1000 + len(w) for w in text.split()]
)


def speech(multilingual: bool) -> SpeechModel:
    return SpeechModel(
        feature_extractor=None, tokenizer=TOKENIZER,
        language_ids={"en": 50259, "de": 50261} if multilingual else {},
        task_ids={"transcribe": 50359, "translate": 50358} if multilingual else {},
        start_id=SOT, prev_id=PREV, no_timestamps_id=NO_TIMESTAMPS, eos_id=EOT,
    )  # fmt: skip


def test_a_multilingual_prompt_names_language_and_task() -> None:
    model = speech(True)
    assert model.decoder_prompt("de", "translate", None, False) == [SOT, 50261, 50358, NO_TIMESTAMPS]
    assert model.decoder_prompt("en", "transcribe", None, True) == [SOT, 50259, 50359]  # timestamps
    assert model.decoder_prompt(None, "transcribe", None, False) == [SOT]  # detection's prompt
    assert model.decoder_prompt("en", "transcribe", "hi there", False) == [
        PREV,
        1002,
        1005,
        SOT,
        50259,
        50359,
        NO_TIMESTAMPS,
    ]
    assert model.check_language("en") is None and "unsupported language" in str(model.check_language("xx"))


def test_an_english_only_prompt_names_neither() -> None:
    model = speech(False)
    assert model.decoder_prompt(None, "transcribe", None, False) == [SOT, NO_TIMESTAMPS]
    assert model.decoder_prompt("en", "transcribe", None, True) == [SOT]
    assert model.check_language("en") is None and "English-only" in str(model.check_language("de"))
    assert model.timestamp_begin == NO_TIMESTAMPS + 1
