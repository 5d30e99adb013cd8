"""BlockPool: every KV block, pre-allocated, with ref counts, an LRU free queue and the prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from engine.kv_cache.hashing import BlockHash

BlockHashWithGroupId = tuple[BlockHash, int]


class KVCacheBlock:
    """One block of the paged cache: its id, how many requests hold it, and its prefix-cache key.

    The key is ``(block hash, KV-cache group id)``: groups share the pool but not their contents.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHashWithGroupId] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass
class PrefixCacheStats:
    """Counted in tokens: how many were looked up and how many were found."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    """Hands out free blocks least-recently-freed first; cached blocks stay reusable until evicted.

    With ``reserve_null_block`` block 0 is never handed out: it stands in block tables for the blocks a
    sliding-window group has already freed (no kernel reads it unmasked, nothing writes to it).
    """

    def __init__(self, num_blocks: int, reserve_null_block: bool = False):
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front first); cached-and-free blocks sit here too.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.null_block: Optional[KVCacheBlock] = None
        if reserve_null_block:
            self.null_block = self.free_queue.pop(0)
        self.num_usable_blocks = len(self.free_queue)
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self.num_evictions = 0
        self.num_cache_changes = 0  # grows whenever a hash is cached or evicted (the DP prefix summary is stale)

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get((block_hash, group_id))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks off the front of the free queue, evicting their cached hashes."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool ({len(self.free_queue)} free)")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                self.num_cache_changes += 1
            block.block_hash = None
            self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request takes cached blocks: free ones leave the free queue; ref counts go up."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the back of the free queue.

        Callers pass a request's blocks tail first, so that tails are evicted before shared prefixes.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Give blocks ``[num_cached_blocks, num_full_blocks)`` their keys and make them findable."""
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None or block is self.null_block:
                continue  # a prefix-cache hit (already registered) or a slid-out placeholder
            key = (block_hashes[index], group_id)
            block.block_hash = key
            if self.cached_block_hash_to_block.setdefault(key, block) is block:
                self.num_cache_changes += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cache_changes += 1
        return True
