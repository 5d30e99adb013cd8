"""Per-group block bookkeeping: which blocks each request holds in one KV-cache group."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.spec import KVCacheSpec, MambaSpec, SlidingWindowSpec


class SingleTypeKVCacheManager:
    """Blocks of one group for every request (full attention: every block stays until the end).

    ``num_held_blocks`` / ``peak_held_blocks`` count the real blocks this group's requests reference
    (a block shared by two requests counts twice), so tests and metrics can see each group's footprint.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool, group_id: int = 0):
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.group_id = group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_blocks: dict[str, int] = {}
        self.num_held_blocks = 0
        self.peak_held_blocks = 0

    def _held(self, delta: int) -> None:
        self.num_held_blocks += delta
        self.peak_held_blocks = max(self.peak_held_blocks, self.num_held_blocks)

    def _is_real(self, block: KVCacheBlock) -> bool:
        return block is not self.block_pool.null_block

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        num_required = -(-num_tokens // self.block_size)
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        # Hit blocks that nobody holds sit in the free queue: taking them uses up free blocks too.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and self._is_real(block))
        return max(num_new, 0) + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        if new_computed_blocks:
            assert not self.req_to_blocks[request_id], "prefix hits only come before the first allocation"
            self.req_to_blocks[request_id].extend(new_computed_blocks)
            self.num_cached_blocks[request_id] = len(new_computed_blocks)
            self._held(sum(1 for block in new_computed_blocks if self._is_real(block)))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self._held(num_new)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        num_cached = self.num_cached_blocks.get(request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request_id], block_hashes, num_cached, num_full, self.group_id
            )
            self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self._held(-sum(1 for block in blocks if self._is_real(block)))
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request_id, None)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks of the longest prefix of whole blocks within ``max_length`` tokens."""
        hits = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention needs every block until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding-window group: blocks that slid out of every future token's window go back to the pool.

    A token at position ``p`` attends to positions ``p - sliding_window + 1 .. p``. Freed blocks keep their
    place in the request's block list as the pool's null block, so block-table columns stay aligned.
    """

    def __init__(self, spec: SlidingWindowSpec, block_pool: BlockPool, enable_caching: bool, group_id: int = 0):
        if block_pool.null_block is None:
            raise ValueError("a sliding-window group needs a BlockPool with reserve_null_block=True")
        self.null_block: KVCacheBlock = block_pool.null_block
        super().__init__(spec, block_pool, enable_caching, group_id)
        self.sliding_window = spec.sliding_window
        # whole blocks a cache hit must end with: the window of the first recomputed token
        self.window_blocks = -(-(self.sliding_window - 1) // self.block_size)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1)
        null = self.null_block
        removed = []
        for index in range(min(first_needed // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[index] is null:
                break  # everything before was removed on an earlier step
            removed.append(blocks[index])
            blocks[index] = null
        if removed:
            self._held(-len(removed))
            self.block_pool.free_blocks(removed)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix whose last ``window_blocks`` blocks are cached (earlier ones need not be).

        Scans from the right; a run reaching the start of the prompt also counts, however short.
        """
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        hits = [self.null_block] * num_blocks
        if self.window_blocks == 0:
            return hits  # a window of one token: no earlier key is ever read
        run = 0
        for index in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[index], self.group_id)
            if block is None:
                run = 0
                continue
            hits[index] = block
            run += 1
            if run >= self.window_blocks:
                return hits[: index + self.window_blocks]
        return hits[:run]


class MambaManager(SingleTypeKVCacheManager):
    """A Mamba group: one block per request holds each layer's running state, from the first step to the end.

    The state after a prefix is not kept per block, so a Mamba group has no prefix hits and caches nothing (the
    engine turns prefix caching off for such models and says so at start-up).
    """

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        assert not new_computed_blocks, "a Mamba group has no prefix hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        if self.req_to_blocks[request_id]:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id].extend(new_blocks)
        self._held(1)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """A running state is never a cached prefix."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []


def manager_for_spec(
    spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool, group_id: int = 0
) -> SingleTypeKVCacheManager:
    """The manager class that matches a spec's attention type."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, enable_caching, group_id)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, block_pool, enable_caching, group_id)
    return SingleTypeKVCacheManager(spec, block_pool, enable_caching, group_id)
