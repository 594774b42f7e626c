"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from frontend.engine.detokenizer import IncrementalDetokenizer
from protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):  # type: ignore[no-untyped-def]
    return smollm2_tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you?",
        "naïve café — 東京 🚀 ünïcödé",
        "  leading spaces\n\nand\ttabs",
        "emoji 👩‍👩‍👧 family",
    ],
)
def test_incremental_text_equals_full_decode(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    pieces = [detok.update([token_id], finished=False) for token_id in ids]
    pieces.append(detok.update([], finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)  # no half characters leak


def test_stop_string_never_leaks_into_streamed_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("The answer is 42. Then more text follows", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["42. Then"]))
    streamed = ""
    for token_id in ids:
        streamed += detok.update([token_id], finished=False)
        assert "42" not in streamed
        if detok.stop_matched:
            break
    streamed += detok.update([], finished=True)
    assert detok.stop_matched == "42. Then"
    assert streamed == detok.text == "The answer is "


def test_include_stop_string(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["three"], include_stop_str_in_output=True))
    out = "".join(detok.update([t], finished=False) for t in ids)
    assert out == "one two three" and detok.stop_matched == "three"


def test_special_tokens_skipped_or_kept(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = [*tokenizer("Hi", add_special_tokens=False)["input_ids"], 2]  # 2 = <|im_end|>
    skip = IncrementalDetokenizer(tokenizer, SamplingParams())
    keep = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=False))
    assert skip.update(ids, finished=True) == "Hi"
    assert keep.update(ids, finished=True) == "Hi<|im_end|>"


def test_min_tokens_holds_off_stop_strings(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """As vLLM: a stop string ends the text only once more than min_tokens tokens exist."""
    ids = tokenizer(" stop here stop there", add_special_tokens=False)["input_ids"]
    early = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["stop"]))
    late = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["stop"], min_tokens=2))
    for detok in (early, late):
        for token_id in ids:
            detok.update([token_id], finished=False)
            if detok.stop_matched:
                break
    assert early.text == " " and late.text == " stop here "
