"""Whisper's timestamp rules (worker/timestamp_rules.py) and begin_suppress_token_ids, token by token on a
toy vocabulary: text 0..7, EOS 8, <|notimestamps|> 9, timestamps 10..19."""

from __future__ import annotations

import numpy as np
import torch

from protocol.sampling import SamplingParams, TimestampRules
from worker.sampler import apply_penalties
from worker.timestamp_rules import force_timestamps, timestamp_masks

RULES = TimestampRules(timestamp_begin=10, no_timestamps=9, eos=8, max_initial_index=2)
VOCAB = 20


def allowed_after(output: list[int]) -> list[int]:
    mask, rows = timestamp_masks([SamplingParams(timestamp_rules=RULES)], [np.array(output)], VOCAB, None)
    assert rows == [(0, 10)]
    return [i for i in range(VOCAB) if mask[0, i]]


def test_the_output_opens_with_an_early_timestamp() -> None:
    assert allowed_after([]) == [10, 11, 12]


def test_timestamps_pair_up_and_never_go_back() -> None:
    assert allowed_after([10]) == [*range(8), 8]  # after the opening timestamp: text (or EOS)
    assert allowed_after([10, 3, 4]) == [*range(8), 8, *range(11, 20)]  # text, EOS, or a later timestamp
    assert allowed_after([10, 3, 14]) == [8, *range(14, 20)]  # a segment's end: the next start, or EOS
    assert allowed_after([10, 3, 14, 14]) == [*range(8), 8]  # a pair: text


def test_a_timestamp_wins_when_the_timestamps_together_beat_every_text_token() -> None:
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 2] = 0.0  # the likeliest text token
    logits[0, 10:] = -1.0  # ten timestamps, each less likely than it, together more
    force_timestamps(logits, [(0, 10), (1, 10)])
    assert torch.isinf(logits[0, :10]).all() and not torch.isinf(logits[0, 10:]).any()
    assert not torch.isinf(logits[1]).any()


def test_begin_suppress_holds_for_the_first_token_only() -> None:
    from protocol.worker_messages import NewRequestData
    from worker.input_batch import InputBatch
    from worker.sampling_batch import sampling_batch

    params = SamplingParams(temperature=0.0, begin_suppress_token_ids=[2, 8])
    batch = InputBatch(max_num_seqs=2, max_model_len=16, block_size=4)
    batch.add(NewRequestData("first", [1, 2], [], params, [0], 0))
    batch.add(NewRequestData("later", [1, 2], [5], params, [1], 0))  # one output token already
    states = [batch.requests["first"], batch.requests["later"]]
    sampling = sampling_batch(batch, states, VOCAB, [8], torch.Generator(), None, None)
    logits = apply_penalties(torch.zeros(2, VOCAB), sampling)
    assert torch.isinf(logits[0, [2, 8]]).all() and torch.isinf(logits[0]).sum() == 2
    assert not torch.isinf(logits[1]).any()


def test_segments_are_placed_at_their_windows_offset() -> None:
    """A later window's timestamps count from its own start (frontend/audio/pipeline.py's segments_of)."""
    from types import SimpleNamespace

    from frontend.audio.pipeline import Window, segments_of

    speech = SimpleNamespace(
        timestamp_begin=10,
        eos_id=8,
        tokenizer=SimpleNamespace(decode=lambda ids, **_: "".join(map(str, ids))),
    )
    window = Window(1, 29.5, 59.5, None, token_ids=[10, 1, 2, 60, 60, 3, 8])  # type: ignore[arg-type]
    segments = segments_of(window, speech)  # type: ignore[arg-type]
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [(29.5, 30.5, "12"), (30.5, 59.5, "3")]
