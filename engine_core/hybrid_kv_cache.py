"""Two block tables per request for a model that mixes full-attention and windowed layers (Gemma 2 and 3,
OLMo 3, Command R7B, Qwen2 with max_window_layers): ModelInfo.num_window_blocks > 0.

The full layers keep a request's whole context in their pool (`full`); the windowed layers keep only what
their window sees in a pool of their own (`sliding`, a KVCacheManager with the window), whose blocks go
back as they fall behind it. Both tables index the same positions, so a request's n-th block is the same
tokens in each. The worker holds one KV tensor per layer, sized by its group's pool (worker/kv_groups.py),
and reads each layer's group's table.

A prefix-cache hit must hold in both: every full block of the prefix, and the sliding blocks its first
query's window still sees (the ones behind it come back as placeholders). The hit is the longest prefix
for which both are cached.

Invariants (check_invariants): each group's; a request holds entries in both or in neither, the same
positions covered; the sliding table sent to the worker is a prefix of the request's table.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.block_pool import KVCacheBlock
from engine_core.config import SchedulerConfig
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request


class HybridKVCacheManager:
    def __init__(
        self, num_blocks: int, num_window_blocks: int, block_size: int, enable_caching: bool, window: int
    ) -> None:
        assert window > 0 and num_window_blocks > 0
        self.block_size = block_size
        self.window = window
        self.full = KVCacheManager(num_blocks, block_size, enable_caching)
        self.sliding = KVCacheManager(num_window_blocks, block_size, enable_caching, window)
        self.pool = self.full.pool  # the pool whose size the engine reports (num_kv_blocks)
        self.req_to_blocks = self.full.req_to_blocks
        self.num_sent: dict[str, int] = {}  # how much of a request's sliding table the worker holds
        self.hit: tuple[str, list[KVCacheBlock]] | None = None  # the sliding blocks of the last lookup

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.sliding.usage)

    @property
    def prefix_cache_queries(self) -> int:
        return self.full.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.full.prefix_cache_hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix cached in both groups (the full blocks, and a token count); the sliding
        blocks are kept for the allocate_slots that follows."""
        blocks, num_tokens = self.full.get_computed_blocks(request)
        num, sliding = len(blocks), None
        while num and sliding is None:
            sliding = self._sliding_hit(request, num)
            num -= sliding is None
        self.full.prefix_cache_hits -= num_tokens - num * self.block_size
        self.hit = (request.request_id, sliding or [])
        return blocks[:num], num * self.block_size

    def _sliding_hit(self, request: Request, num: int) -> list[KVCacheBlock] | None:
        """The sliding table of a hit of `num` blocks (placeholders behind the window of the query at
        num * block_size), or None if a block the window sees is not cached."""
        first = max(num * self.block_size - self.window + 1, 0) // self.block_size
        blocks = [self.sliding.behind] * first
        for block_hash in request.block_hashes[first:num]:
            block = self.sliding.pool.get_cached_block(block_hash)
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Blocks in both groups, or None (and no change in either) if one pool is short; returns the
        full group's new blocks (the sliding ones reach the worker through new_window_block_ids)."""
        sliding: list[KVCacheBlock] = []
        if new_computed_blocks:
            assert self.hit is not None and self.hit[0] == request.request_id
            sliding = self.hit[1]
            assert len(sliding) == len(new_computed_blocks)
        self.hit = None
        if self.full.num_blocks_short(request, num_new_tokens, new_computed_blocks):
            return None
        if self.sliding.num_blocks_short(request, num_new_tokens, sliding):
            return None
        new_blocks = self.full.allocate_slots(request, num_new_tokens, new_computed_blocks)
        assert self.sliding.allocate_slots(request, num_new_tokens, sliding) is not None
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        self.full.cache_blocks(request)
        self.sliding.cache_blocks(request)

    def free_behind_window(self, request: Request) -> None:
        self.sliding.free_behind_window(request)

    def free(self, request: Request) -> None:
        self.full.free(request)
        self.sliding.free(request)
        self.num_sent.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.full.get_block_ids(request_id)

    def take_window_block_ids(self, request_id: str, new: bool) -> list[int]:
        """The sliding table's entries the worker does not hold yet (all of it for a request new to the
        worker): entries are only ever appended, so the worker's copy stays a prefix."""
        ids = self.sliding.get_block_ids(request_id)
        start = 0 if new else self.num_sent.get(request_id, 0)
        self.num_sent[request_id] = len(ids)
        return ids[start:]

    def check_window(self, request: Request) -> None:
        self.sliding.check_window(request)

    def reset_prefix_cache(self) -> bool:
        # both or neither: the full pool refuses while any block is in use, and then so would the other
        return self.full.reset_prefix_cache() and self.sliding.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.sliding.check_invariants()
        assert self.full.req_to_blocks.keys() == self.sliding.req_to_blocks.keys()
        for request_id, blocks in self.full.req_to_blocks.items():
            assert len(self.sliding.req_to_blocks[request_id]) == len(blocks), request_id
            assert self.num_sent.get(request_id, 0) <= len(blocks), request_id


def kv_cache_for(config: SchedulerConfig) -> KVCacheManager | HybridKVCacheManager:
    if config.num_window_blocks:
        return HybridKVCacheManager(
            config.num_kv_blocks,
            config.num_window_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.kv_window,
        )
    return KVCacheManager(
        config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.kv_window
    )
