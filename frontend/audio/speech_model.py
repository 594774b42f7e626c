"""What an API server knows of a Whisper model: its feature extractor, its special tokens, and how a
request's decoder prompt and sampling follow from them.

The log-mel features come from transformers' WhisperFeatureExtractor (the model's own processor, as its
preprocessor_config.json describes it), so the engine's input equals what transformers feeds the model.
The decoder prompt is vLLM's and transformers': `[<|startofprev|> prompt] <|startoftranscript|> <|lang|>
<|transcribe|> or <|translate|> [<|notimestamps|>]`. Sampling suppresses the generation config's
`suppress_tokens` at every step and its `begin_suppress_tokens` at the first (as transformers' generate does).
An answer placed in time (verbose_json, srt, vtt) runs with timestamp tokens under transformers' timestamp
rules (worker/timestamp_rules.py): the prompt has no <|notimestamps|>, and the text between two timestamps
is one segment.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.media import EncoderInput
from protocol.sampling import TimestampRules

SAMPLE_RATE = 16000
TIME_PRECISION_S = 0.02  # one timestamp token's step


@dataclass(frozen=True)
class SpeechModel:
    feature_extractor: Any  # transformers' WhisperFeatureExtractor
    tokenizer: Any
    language_ids: dict[str, int]  # "en" -> the id of <|en|>
    task_ids: dict[str, int]  # "transcribe", "translate"
    start_id: int  # <|startoftranscript|>
    prev_id: int | None  # <|startofprev|>
    no_timestamps_id: int  # <|notimestamps|>; the timestamp tokens follow it
    eos_id: int
    suppress_ids: list[int] = field(default_factory=list)
    begin_suppress_ids: list[int] = field(default_factory=list)
    encoder_len: int = 1500
    max_initial_index: int = 50  # the first timestamp's greatest step (1.0 s)

    @classmethod
    def load(cls, folder: str, tokenizer: Any, encoder_len: int) -> SpeechModel:
        from transformers import WhisperFeatureExtractor

        with open(os.path.join(folder, "generation_config.json")) as f:
            generation = json.load(f)
        languages = generation.get("lang_to_id") or {}
        return cls(
            feature_extractor=WhisperFeatureExtractor.from_pretrained(folder),
            tokenizer=tokenizer,
            language_ids={key.strip("<|>"): value for key, value in languages.items()},
            task_ids=dict(generation.get("task_to_id") or {}),
            start_id=generation["decoder_start_token_id"],
            prev_id=generation.get("prev_sot_token_id"),
            no_timestamps_id=generation["no_timestamps_token_id"],
            eos_id=_first(generation["eos_token_id"]),
            suppress_ids=list(generation.get("suppress_tokens") or []),
            begin_suppress_ids=list(generation.get("begin_suppress_tokens") or []),
            encoder_len=encoder_len,
            max_initial_index=int(generation.get("max_initial_timestamp_index") or 50),
        )

    @property
    def timestamp_begin(self) -> int:
        """<|0.00|>: timestamp token t stands for (t - timestamp_begin) * 0.02 s."""
        return self.no_timestamps_id + 1

    @property
    def chunk_samples(self) -> int:
        """The encoder's window: 30 s at 16 kHz for every released Whisper."""
        return 2 * self.encoder_len * int(self.feature_extractor.hop_length)

    def features(self, samples: np.ndarray) -> EncoderInput:
        """samples: float32 mono at 16 kHz, at most one window -> the encoder's [num_mel_bins, frames] input."""
        extracted = self.feature_extractor(
            samples, sampling_rate=SAMPLE_RATE, return_tensors="np", return_attention_mask=False
        )
        array = np.ascontiguousarray(extracted["input_features"][0], dtype="<f4")
        data = array.tobytes()
        return EncoderInput(data, list(array.shape), hashlib.sha256(data).hexdigest(), self.encoder_len)

    def decoder_prompt(
        self, language: str | None, task: str, previous_text: str | None, timestamps: bool
    ) -> list[int]:
        """The decoder's prompt; a multilingual model's with language None: the start token alone (the
        language-detection request's). An English-only model's names neither language nor task."""
        ids: list[int] = []
        if previous_text and self.prev_id is not None:
            previous = self.tokenizer.encode(" " + previous_text.strip(), add_special_tokens=False)
            ids = [self.prev_id, *previous[-(MAX_PREVIOUS_TOKENS):]]
        ids.append(self.start_id)
        if (
            self.language_ids
        ):  # a multilingual model names the language and the task; an English-only one neither
            if language is None:
                return ids  # the language-detection request's prompt
            ids += [self.language_ids[language], self.task_ids[task]]
        # with timestamps the model opens the first segment itself (timestamp_rules), as transformers runs it
        return ids if timestamps else [*ids, self.no_timestamps_id]

    def timestamp_rules(self) -> TimestampRules:
        return TimestampRules(
            self.timestamp_begin, self.no_timestamps_id, self.eos_id, self.max_initial_index
        )

    def language_of(self, token_id: int) -> str:
        return next(code for code, value in self.language_ids.items() if value == token_id)

    def check_language(self, language: str) -> str | None:
        """None when the model knows `language` (an ISO 639-1 code, e.g. "en"); else why not."""
        if not self.language_ids:
            return None if language == "en" else "this model is English-only: its language is `en`"
        if language not in self.language_ids:
            return (
                f"unsupported language {language!r}; this model knows: {', '.join(sorted(self.language_ids))}"
            )
        return None


# transformers' WhisperGenerationMixin keeps the last max_target_positions // 2 - 1 tokens of a prompt
MAX_PREVIOUS_TOKENS = 223


def _first(value: int | list[int]) -> int:
    return value[0] if isinstance(value, list) else value
