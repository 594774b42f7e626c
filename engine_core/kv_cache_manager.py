"""Per-request block tables on top of the BlockPool, with prefix caching.

A model whose every layer slides a window (ModelInfo.kv_window: Mistral 7B v0.1, StarCoder2, Phi-3-mini)
never reads a key more than a window behind the next query: once a request's block falls entirely behind it,
the block goes back to the pool (still indexed, so the prefix cache may revive it), and the request's table
keeps a placeholder (`behind`) in its place, so positions still index it.

Invariants (check_invariants):
- a block's ref count equals the number of block tables holding it (placeholders hold none);
- a request holds ceil(tokens with KV / block_size) entries at least, never a block twice;
- only blocks whose KV is written are indexed (cache_blocks runs after the step that wrote them);
- a placeholder sits only behind the window of the request's next query.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine_core.block_pool import BlockPool, KVCacheBlock
from engine_core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, window: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        # in a table, for a block freed behind the window: never read, never counted (id 0 to workers)
        self.behind = KVCacheBlock(-1)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are indexed
        self.num_behind: dict[str, int] = {}  # how many of a request's leading blocks are placeholders
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs need the logits of every prompt position, so nothing may be skipped.
            return [], 0
        # NOTE: the last token is always recomputed so that the step produces its logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_tokens
        return blocks, num_tokens

    def num_blocks_short(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> int:
        """How many blocks the pool lacks for allocate_slots (0: it would succeed)."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        num_computed = request.num_computed_after_flight + len(new_computed_blocks) * self.block_size
        num_needed = (
            cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        )
        # Cached blocks on the free queue are about to be revived, so they do not count as free.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return max(num_needed - (self.pool.num_free_blocks - num_revived), 0)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Reserve blocks for num_new_tokens more tokens; None (and no change) if the pool is short.
        new_computed_blocks (a prefix-cache hit, for a request that holds none) may begin with placeholders
        for blocks behind the window of its first query."""
        if self.num_blocks_short(request, num_new_tokens, new_computed_blocks):
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_after_flight + len(new_computed_blocks) * self.block_size
        num_needed = (
            cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        )
        num_behind = sum(1 for block in new_computed_blocks if block is self.behind)
        if num_behind:
            assert not blocks and all(b is self.behind for b in new_computed_blocks[:num_behind])
            self.num_behind[request.request_id] = num_behind
        self.pool.touch(new_computed_blocks[num_behind:])
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose KV is written (called after each step)."""
        if not self.enable_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        # placeholders are never indexed (a hit's, or blocks freed before their hash was known)
        start = max(
            self.num_cached_blocks.get(request.request_id, 0), self.num_behind.get(request.request_id, 0)
        )
        if num_full > start:
            blocks = self.req_to_blocks[request.request_id]
            self.pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
            self.num_cached_blocks[request.request_id] = num_full

    def free_behind_window(self, request: Request) -> None:
        """With a window: give back the request's blocks that its next query (at num_computed_tokens) and
        every later one cannot see (keys p - window < k <= p). Called after the step's blocks are indexed."""
        if not self.window:
            return
        first_seen = request.num_computed_tokens - self.window + 1
        blocks = self.req_to_blocks.get(request.request_id)
        if first_seen <= 0 or not blocks:
            return
        start = self.num_behind.get(request.request_id, 0)
        end = min(first_seen // self.block_size, len(blocks))
        if end <= start:
            return
        # NOTE: a block still scheduled in flight is never one of these: the step in flight reads from the
        # query at num_computed_tokens on, and a freed block is only written in a step after it
        self.pool.free_blocks(blocks[start:end])
        blocks[start:end] = [self.behind] * (end - start)
        self.num_behind[request.request_id] = end

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_behind.pop(request.request_id, None)
        # Tail blocks are the least likely to be shared: evict them first.
        self.pool.free_blocks(block for block in reversed(blocks) if block is not self.behind)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A request's table for the workers; a placeholder behind the window reads as block 0 (never read)."""
        return [max(block.block_id, 0) for block in self.req_to_blocks.get(request_id, [])]

    def take_window_block_ids(self, request_id: str, new: bool) -> list[int]:
        return []  # one pool (HybridKVCacheManager has a second)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_window(self, request: Request) -> None:
        """No block that a query of the steps in flight or to come may see was given back."""
        behind = self.num_behind.get(request.request_id, 0)
        assert behind <= max(request.num_computed_tokens - self.window + 1, 0) // self.block_size, request

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, blocks in self.req_to_blocks.items():
            ids = [block.block_id for block in blocks if block is not self.behind]
            assert len(ids) == len(set(ids)), ids
            behind = self.num_behind.get(request_id, 0)
            assert all(block is self.behind for block in blocks[:behind]), request_id
            assert all(block is not self.behind for block in blocks[behind:]), request_id
            holders.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
