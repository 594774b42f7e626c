"""Incremental detokenization with stop strings.

Text is produced token by token with the tokenizers library's DecodeStream (correct for multi-byte
UTF-8 and SentencePiece spacing). Stop strings are matched on the text; the last
len(longest stop) - 1 characters are held back, so a stop string never leaks into streamed text.
"""

from __future__ import annotations

from typing import Any

from protocol.sampling import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any | None, params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = None if tokenizer is None else tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = params.min_tokens  # as vLLM: no stop string ends the text before this many tokens
        self._num_tokens = 0
        self.text = ""  # all text so far (up to and maybe including a matched stop string)
        self._emitted = 0  # characters of self.text already returned
        self.stop_matched: str | None = None

    def update(self, token_ids: list[int], finished: bool) -> str:
        """Feed new tokens; return the text that may be shown now."""
        if self._tokenizer is None or self.stop_matched is not None:
            return ""
        for token_id in token_ids:
            self._num_tokens += 1
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                continue
            search_from = max(len(self.text) - self._hold, 0)
            self.text += piece
            if self.stop and self._num_tokens > self.min_tokens and self._match_stop(search_from):
                finished = True
                break
        end = len(self.text) if finished else max(len(self.text) - self._hold, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _match_stop(self, search_from: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.stop_matched = stop
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return True
