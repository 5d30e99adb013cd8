"""BlockPool: every KV block, pre-allocated, with ref counts, an LRU free queue and the prefix cache."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from engine.kv_cache.hashing import BlockHash


class KVCacheBlock:
    """One block of the paged cache: its id, how many requests hold it, and its prefix hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass
class PrefixCacheStats:
    """Counted in tokens: how many were looked up and how many were found."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Hands out free blocks least-recently-freed first; cached blocks stay reusable until evicted."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front first); cached-and-free blocks sit here too.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

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
            block.block_hash = None
            self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request takes cached blocks: free ones leave the free queue; ref counts go up."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the back of the free queue.

        Callers pass a request's blocks tail first, so that tails are evicted before shared prefixes.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Give blocks ``[num_cached_blocks, num_full_blocks)`` their hashes and make them findable."""
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None:
                continue  # a prefix-cache hit, already registered
            block_hash = block_hashes[index]
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
