"""How many prefill tokens a step carries while requests decode: what an inter-token gap holds.

Served, a step that prefills a whole budget makes every decoding request wait through it. So while any
request decodes, a step prefills at most `decode_prefill_token_budget` tokens, or more where the share grows:
`decode_prefill_tokens_per_decode` for each decoding request, or `decode_prefill_tokens_per_request` for each
request the engine holds (running and waiting, at most max_num_seqs). Counting the requests held keeps a
burst's ramp fed: after its first step only some requests decode while the rest still wait, and a share of
the decoding ones alone would prefill the others slowly (benchmarks/results/
2026-12-07-lab-notes-speech-attention-zen4.md, "A smaller prefill share at c=16").
"""

from __future__ import annotations

from engine_core.config import SchedulerConfig


def prefill_share(config: SchedulerConfig, decoding: int, held: int) -> int:
    """The step's prefill tokens, given the requests decoding and the requests held (running, waiting)."""
    budget, cap = config.max_num_batched_tokens, config.decode_prefill_token_budget
    if cap <= 0 or not decoding:
        return budget
    share = max(
        cap,
        config.decode_prefill_tokens_per_decode * decoding,
        config.decode_prefill_tokens_per_request * min(held, config.max_num_seqs),
    )
    return min(budget, share)
