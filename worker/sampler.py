"""The sampler: a pure function of logits and per-request parameters.

Logprobs are those of the raw model distribution (before penalties, bias and temperature), as in
vLLM's default, so they are comparable with Hugging Face's log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol.messages import Logprobs
from worker.timestamp_rules import force_timestamps

if TYPE_CHECKING:
    from protocol.sampling import SamplingParams
    from worker.csrc_ops import CpuOps

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplingBatch:
    """Per-row parameters for the rows being sampled, built by the model runner each step."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor | None  # [B] long; 0 disables
    top_p: torch.Tensor | None  # [B] float32; 1 disables
    min_p: torch.Tensor | None  # [B] float32; 0 disables
    seeds: list[int | None]  # per-row seed, mixed with the output position
    num_output_tokens: list[int]  # per row, before this step's token
    generator: torch.Generator | None  # for unseeded rows
    output_token_ids: torch.Tensor | None = None  # [B, max_out] padded with vocab_size, for penalties
    prompt_token_ids: torch.Tensor | None = None  # [B, max_prompt] padded with vocab_size
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    bias_rows: torch.Tensor | None = None  # [N] logit_bias entries: row, token, value
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None  # [M] min_tokens: (row, token) pairs masked to -inf
    banned_tokens: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None  # [B, vocab] bool: allowed_token_ids (rows without: all True)
    # (row, its first timestamp id): Whisper rows whose text tokens give way when the timestamps' summed
    # probability beats each (worker/timestamp_rules.py)
    timestamp_rows: list[tuple[int, int]] | None = None
    max_num_logprobs: int | None = None  # None: no logprobs for any row
    label_ids: torch.Tensor | None = None  # [B, L] each row's logprob_token_ids (padded with 0), if any has
    ops: CpuOps | None = None  # the csrc kernels (a vectorized argmax), or None for torch's

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return argmax(logits, self.ops)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @property
    def changes_logits(self) -> bool:
        """Some row has a logit bias, a min_tokens ban or a repetition/presence/frequency penalty."""
        return (
            self.bias_rows is not None
            or self.repetition_penalty is not None
            or self.banned_rows is not None
            or self.allowed_mask is not None
            or bool(self.timestamp_rows)
        )

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, nothing that changes or reports the distribution: an argmax is enough."""
        return self.max_num_logprobs is None and not self.changes_logits and self.all_greedy


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + k]: sampled, then top k
    logprobs: torch.Tensor | None = None  # [B, 1 + k]
    ranks: torch.Tensor | None = None  # [B] rank of the sampled token
    label_logprobs: torch.Tensor | None = None  # [B, L] the logprobs of SamplingBatch.label_ids


def argmax(logits: torch.Tensor, ops: CpuOps | None) -> torch.Tensor:
    """[B, vocab] -> [B] long: each row's first greatest logit (the csrc kernel, vectorized, where given)."""
    if ops is not None and logits.dtype in (torch.float32, torch.bfloat16):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [B, vocab] in the model's dtype: a plain greedy batch takes the argmax of those (the same
    token: every bfloat16 is a float32, ties go to the first index), anything else works in float32."""
    if batch.plain_greedy:
        return SamplerOutput(batch.argmax(logits))
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs is not None else None
    logits = apply_penalties(logits, batch)
    greedy = batch.argmax(logits)  # [B]
    if batch.all_greedy:
        token_ids = greedy
    else:
        token_ids = torch.where(batch.temperature == 0, greedy, _sample_random(logits, batch))
    output = SamplerOutput(token_ids)
    if raw_logprobs is not None:
        assert batch.max_num_logprobs is not None
        output.logprob_token_ids, output.logprobs, output.ranks = gather_logprobs(
            raw_logprobs, token_ids, batch.max_num_logprobs
        )
        if batch.label_ids is not None:
            output.label_logprobs = raw_logprobs.gather(-1, batch.label_ids)
    return output


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: [B, vocab]; token_ids: [B] -> ids [B, 1 + k], logprobs [B, 1 + k], ranks [B]."""
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [B, 1]
    ranks = (logprobs > chosen).sum(-1) + 1  # [B]
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [B, k]
        return torch.cat([token_ids.unsqueeze(-1), top_ids], -1), torch.cat([chosen, top_values], -1), ranks
    return token_ids.unsqueeze(-1), chosen, ranks


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, min_tokens and bad-word bans, allowed_token_ids, repetition/presence/frequency
    penalties; never modifies its input."""
    if not batch.changes_logits:
        return logits
    logits = logits.clone()
    num_rows, vocab_size = logits.shape
    if batch.bias_rows is not None:
        assert batch.bias_tokens is not None and batch.bias_values is not None
        logits.index_put_((batch.bias_rows, batch.bias_tokens), batch.bias_values, accumulate=True)
    if batch.repetition_penalty is not None:
        assert batch.prompt_token_ids is not None and batch.output_token_ids is not None
        seen = _token_mask(batch.prompt_token_ids, vocab_size) | _token_mask(
            batch.output_token_ids, vocab_size
        )
        penalty = batch.repetition_penalty.unsqueeze(1)  # [B, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        assert batch.output_token_ids is not None and batch.presence_penalty is not None
        counts = _token_counts(batch.output_token_ids, vocab_size)  # [B, vocab]
        logits -= batch.frequency_penalty.unsqueeze(1) * counts
        logits -= batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    if batch.banned_rows is not None:
        logits[batch.banned_rows, batch.banned_tokens] = float("-inf")
    if batch.allowed_mask is not None:
        logits = logits.masked_fill(~batch.allowed_mask, float("-inf"))
    if batch.timestamp_rows:
        force_timestamps(logits, batch.timestamp_rows)
    return logits


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids: [B, n] padded with vocab_size -> counts [B, vocab] float32."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.bool)
    mask.scatter_(1, token_ids, True)
    return mask[:, :vocab_size]


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temperature = torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature)
    logits = logits / temperature.unsqueeze(1)
    logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)  # [B, vocab]
    if batch.min_p is not None:
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.unsqueeze(1)
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator per seeded row.
    noise = torch.empty_like(probs)
    for row, seed in enumerate(batch.seeds):
        if seed is None:
            noise[row].exponential_(generator=batch.generator)
        else:
            generator = torch.Generator().manual_seed(_mix_seed(seed, batch.num_output_tokens[row]))
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _mix_seed(seed: int, position: int) -> int:
    """A per-position seed: the same seed gives the same tokens whatever the batch or preemptions."""
    return ((seed & 0xFFFFFFFF) * _SEED_MIX + position) % (1 << 63)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, vocab]
    vocab_size = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab_size), top_k).clamp(max=vocab_size)
        mask |= torch.arange(vocab_size).unsqueeze(0) >= k.unsqueeze(1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        # Keep a token if the mass before it is below top_p (the top token is always kept).
        mask |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def sampled_logprobs(sampled: SamplerOutput, row: int, params: SamplingParams) -> Logprobs:
    """One sampled row's logprobs: the sampled token's, then the top ones' or exactly the asked tokens'
    (logprob_token_ids)."""
    assert (
        sampled.logprob_token_ids is not None and sampled.logprobs is not None and sampled.ranks is not None
    )
    labels, rank = params.logprob_token_ids, [int(sampled.ranks[row])]
    if labels is not None:
        assert sampled.label_logprobs is not None
        values = sampled.label_logprobs[row, : len(labels)].tolist()
        return Logprobs(
            [[int(sampled.token_ids[row]), *labels]], [[float(sampled.logprobs[row, 0]), *values]], rank
        )
    k = params.logprobs
    assert k is not None
    return Logprobs(
        [sampled.logprob_token_ids[row, : 1 + k].tolist()], [sampled.logprobs[row, : 1 + k].tolist()], rank
    )
