"""Per-group block bookkeeping: which blocks each request holds in one KV-cache group."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec


class SingleTypeKVCacheManager:
    """Blocks of one group for every request (full attention: every block stays until the end)."""

    def __init__(self, spec: FullAttentionSpec, block_pool: BlockPool, enable_caching: bool):
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_blocks: dict[str, int] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        num_required = -(-num_tokens // self.block_size)
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        # Hit blocks that nobody holds sit in the free queue: taking them uses up free blocks too.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return max(num_new, 0) + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        if new_computed_blocks:
            assert not self.req_to_blocks[request_id], "prefix hits only come before the first allocation"
            self.req_to_blocks[request_id].extend(new_computed_blocks)
            self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        num_cached = self.num_cached_blocks.get(request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, num_cached, num_full)
            self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request_id, None)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks of the longest prefix of whole blocks within ``max_length`` tokens."""
        hits = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention needs every block until the request ends."""


def manager_for_spec(spec: FullAttentionSpec, block_pool: BlockPool, enable_caching: bool) -> SingleTypeKVCacheManager:
    """The manager class that matches a spec's attention type."""
    if isinstance(spec, SlidingWindowSpec):
        raise NotImplementedError("sliding-window KV-cache groups need the hybrid coordinator's manager")
    return SingleTypeKVCacheManager(spec, block_pool, enable_caching)
