"""The sampler's per-row parameters for one step (worker/sampler.py's SamplingBatch), from each request's
SamplingParams and its output so far: temperatures, top-k/p, min-p, seeds, penalties, logit bias, banned
tokens (min_tokens, bad words), allowed tokens and the grammar's mask."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from worker.input_batch import InputBatch, RequestState
from worker.sampler import SamplingBatch
from worker.timestamp_rules import timestamp_masks


def sampling_batch(
    input_batch: InputBatch,
    states: list[RequestState],
    vocab_size: int,
    eos_token_ids: list[int],
    generator: torch.Generator,
    ops: Any,
    grammar_mask: torch.Tensor | None = None,
) -> SamplingBatch:
    """grammar_mask: [B, vocab] bool, the tokens each row's grammar allows (structured outputs)."""
    params = [s.sampling_params for s in states]
    outputs = [input_batch.output_token_ids(s) for s in states]
    batch = SamplingBatch(
        temperature=torch.tensor([0.0 if p.is_greedy else p.temperature for p in params]),
        top_k=_optional([p.top_k for p in params], lambda v: v > 0, torch.long),
        top_p=_optional([p.top_p for p in params], lambda v: v < 1.0, torch.float32),
        min_p=_optional([p.min_p for p in params], lambda v: v > 0.0, torch.float32),
        seeds=[p.seed for p in params],
        num_output_tokens=[len(o) for o in outputs],
        generator=generator,
        ops=ops,
    )
    # a row with logprob_token_ids takes those tokens' logprobs, not the top ones
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None and p.logprob_token_ids is None]
    label_rows = [p.logprob_token_ids or [] for p in params]
    batch.max_num_logprobs = max(logprob_counts) if logprob_counts else (0 if any(label_rows) else None)
    if any(label_rows):
        width = max(len(ids) for ids in label_rows)
        batch.label_ids = torch.tensor(
            [ids + [0] * (width - len(ids)) for ids in label_rows], dtype=torch.long
        )
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        batch.output_token_ids = _pad(outputs, vocab_size)
        batch.prompt_token_ids = _pad([input_batch.prompt_token_ids(s) for s in states], vocab_size)
        batch.presence_penalty = torch.tensor([p.presence_penalty for p in params])
        batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
        batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
    bias = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if bias:
        batch.bias_rows = torch.tensor([e[0] for e in bias])
        batch.bias_tokens = torch.tensor([e[1] for e in bias])
        batch.bias_values = torch.tensor([e[2] for e in bias], dtype=torch.float32)
    banned = [
        (row, t)
        for row, p in enumerate(params)
        if len(outputs[row]) < p.min_tokens
        for t in {*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)}
    ]
    banned += [
        (row, t)
        for row, p in enumerate(params)
        if p.bad_words_token_ids
        for t in _bad_word_bans(p.bad_words_token_ids, outputs[row])
    ]
    banned += [
        (row, t) for row, p in enumerate(params) if not len(outputs[row]) for t in p.begin_suppress_token_ids
    ]
    if any(p.allowed_token_ids is not None for p in params):
        allowed = torch.ones(len(params), vocab_size, dtype=torch.bool)  # [B, vocab]
        for row, p in enumerate(params):
            if p.allowed_token_ids is not None:
                allowed[row] = False
                allowed[row, p.allowed_token_ids] = True
        batch.allowed_mask = allowed
    if any(p.timestamp_rules is not None for p in params):
        batch.allowed_mask, batch.timestamp_rows = timestamp_masks(
            params, outputs, vocab_size, batch.allowed_mask
        )
    if grammar_mask is not None:
        batch.allowed_mask = grammar_mask if batch.allowed_mask is None else batch.allowed_mask & grammar_mask
    if banned:
        batch.banned_rows = torch.tensor([e[0] for e in banned])
        batch.banned_tokens = torch.tensor([e[1] for e in banned])
    return batch


def _bad_word_bans(words: list[list[int]], output: np.ndarray) -> set[int]:
    """The last token of each bad word whose other tokens end the output so far (one-token words always)."""
    banned = set()
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (
            not prefix or output[len(output) - len(prefix) :].tolist() == prefix
        ):
            banned.add(word[-1])
    return banned


def _optional(
    values: Sequence[float], active: Callable[[float], bool], dtype: torch.dtype
) -> torch.Tensor | None:
    return torch.tensor(values, dtype=dtype) if any(active(v) for v in values) else None


def _pad(sequences: list[np.ndarray], pad: int) -> torch.Tensor:
    width = max(1, max(len(s) for s in sequences))
    out = np.full((len(sequences), width), pad, dtype=np.int64)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = s
    return torch.from_numpy(out)
