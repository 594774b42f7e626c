"""The KV pools of a model that mixes windowed and full-attention layers (Gemma 2 and 3, OLMo 3, Command
R7B, Qwen2 with max_window_layers): the windowed layers get a pool of their own, sized for what their
windows can hold, and the full layers the rest of the memory (engine_core/hybrid_kv_cache.py keeps a block
table per pool).

A running request holds at most its window's blocks plus the tokens of the steps in flight in the sliding
pool (the engine frees the rest after each step), so the pool is sized for max_num_seqs such requests and
two steps' budgets of tokens (async scheduling keeps one step in flight while it schedules the next). If it
ever runs short the scheduler preempts, as for the full pool: the size is a choice of memory, not of
correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.model_config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVPools:
    num_blocks: int  # the full-attention layers' pool (every layer's, for a model without a mix)
    num_window_blocks: int  # the windowed layers' pool; 0: no second pool
    window: int  # the windowed layers' window (0: no second pool)

    def blocks_of(self, mc: ModelConfig, layer: int) -> int:
        return self.num_window_blocks if self.num_window_blocks and mc.is_sliding(layer) else self.num_blocks


def mixed_window(mc: ModelConfig, max_model_len: int) -> int:
    """The window of the windowed layers when some but not all layers have one shorter than a request
    can be (else 0: one pool serves every layer)."""
    if mc.is_encoder or not mc.sliding_window or mc.kv_window or mc.sliding_window >= max_model_len:
        return 0
    return mc.sliding_window if any(mc.is_sliding(i) for i in range(mc.num_layers)) else 0


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """What the windowed layers' pool needs so that it never runs short before the full one: per request
    the window's blocks, the new token's and one for a window straddling blocks, plus the tokens of two
    steps (one in flight, one being scheduled), each step's chunks rounded up a block per request."""
    per_request = cdiv(window, block_size) + 2
    return max_num_seqs * (per_request + 2) + 2 * cdiv(max_num_batched_tokens, block_size)


def plan_pools(
    mc: ModelConfig,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    explicit: bool,
) -> KVPools:
    """num_blocks: what one pool for every layer would hold in the memory given (or, explicit, the full
    layers' pool size the user asked for). The windowed layers take what they need of that memory, at most
    as much as they would hold in one pool, and the full layers the rest."""
    window = mixed_window(mc, max_model_len)
    if not window:
        return KVPools(num_blocks, 0, 0)
    need = window_pool_blocks(window, block_size, max_num_seqs, max_num_batched_tokens)
    num_window = max(min(need, num_blocks), 1)
    if explicit:
        return KVPools(num_blocks, num_window, window)
    sliding = sum(mc.is_sliding(i) for i in range(mc.num_layers))
    full = mc.num_layers - sliding
    num_full = (num_blocks * mc.num_layers - num_window * sliding) // full
    return KVPools(max(num_full, 1), num_window, window)
