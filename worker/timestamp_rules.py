"""Whisper's timestamp rules (SamplingParams.timestamp_rules), as transformers' WhisperTimeStampLogitsProcessor
and openai/whisper apply them, so that an answer placed in time reads as the model's own:

- <|notimestamps|> is never sampled;
- the first output token is a timestamp of at most max_initial_index steps;
- after a lone timestamp (a segment's end) comes another timestamp or EOS; after a pair (an end and the
  next start), text;
- timestamps never go back (and a segment's start is past the last end);
- a timestamp is taken whenever the timestamps' summed probability beats every single text token's.

The first four depend on the output so far (a mask built with the step's other masks); the last on the
step's logits after every other mask and penalty (as transformers runs its suppressions first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from protocol.sampling import SamplingParams


def timestamp_masks(
    params: Sequence[SamplingParams],
    outputs: Sequence[np.ndarray],
    vocab_size: int,
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The step's allowed mask with each timestamp row's rules in it, and those rows (row, first timestamp)."""
    if allowed is None:
        allowed = torch.ones(len(params), vocab_size, dtype=torch.bool)  # [B, vocab]
    rows = []
    for row, p in enumerate(params):
        rules = p.timestamp_rules
        if rules is None:
            continue
        begin = rules.timestamp_begin
        rows.append((row, begin))
        mask = allowed[row]
        mask[rules.no_timestamps] = False
        seq = outputs[row].tolist()
        if not seq:
            mask[:begin] = False
            mask[begin + rules.max_initial_index + 1 :] = False
            continue
        last_was_timestamp = seq[-1] >= begin
        penultimate_was_timestamp = len(seq) < 2 or seq[-2] >= begin
        if last_was_timestamp:
            if penultimate_was_timestamp:
                mask[begin:] = False  # a pair: text follows
            else:
                mask[: rules.eos] = False  # a segment's end: the next start, or EOS
        timestamps = [token_id for token_id in seq if token_id >= begin]
        if timestamps:
            # a lone last timestamp may repeat as the next segment's start; else strictly later
            last = (
                timestamps[-1] if last_was_timestamp and not penultimate_was_timestamp else timestamps[-1] + 1
            )
            mask[begin:last] = False
    return allowed, rows


def force_timestamps(logits: torch.Tensor, rows: list[tuple[int, int]]) -> None:
    """logits: [B, vocab] float32, masked; in place: text tokens -inf where the timestamps' summed
    probability beats the likeliest text token's."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, vocab]
    for row, begin in rows:
        if logprobs[row, begin:].logsumexp(dim=-1) > logprobs[row, :begin].max():
            logits[row, :begin] = float("-inf")
