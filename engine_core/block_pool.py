"""A fixed pool of KV blocks with ref counts, an LRU free queue and a prefix-cache index.

Invariants (check_invariants):
- a block with ref_cnt == 0 is in the free queue, and every block in the free queue has ref_cnt == 0;
- every entry of the cache index maps a hash to a block carrying that hash;
- evicting a cached block (lazily, when the free queue hands it out) removes its index entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine_core.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # NOTE: insertion order is eviction order: freed blocks go to the tail, new blocks come from the head.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Index blocks[start:end] under their hashes; a hash already indexed keeps its first block."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            if block.block_hash is not None or block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(block)
                self.free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, block
