"""Per-group block bookkeeping: which blocks each request holds in one KV-cache group."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.spec import KVCacheSpec, MambaSpec, SlidingWindowSpec


def required_null_block(block_pool: BlockPool, group_kind: str) -> KVCacheBlock:
    """The pool's null block, which stands in a group's block lists where a position holds no block."""
    if block_pool.null_block is None:
        raise ValueError(f"{group_kind} needs a BlockPool with reserve_null_block=True")
    return block_pool.null_block


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
        self.null_block = required_null_block(block_pool, "a sliding-window group")
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
    """A Mamba group: each layer's running state lives in the block of the request's last computed token.

    The request's block list is positional, as attention's is, but only the block that holds the running state is
    real (the pool's null block stands at every other position): a step reads the state from the block of its first
    token's predecessor and writes it to the block of its last token, and the blocks behind go back to the pool on
    the next step. A step that ends exactly at a block boundary leaves in that block the state after the block's
    last token; no later step writes it, so with prefix caching the block is cached under the block's hash (from
    the request's next step on: a request that hit it in the step that writes it would read it before the write),
    and a request with that prefix resumes from it (``find_longest_cache_hit``: only the last block of a hit must
    be cached). A block whose step ended inside it holds a state of some earlier position and is never cached. The
    scheduler makes prefill chunks end at block boundaries (``KVCacheManager.align_num_new_tokens``); decode passes
    every boundary. A request holds at most two blocks: the one it reads and the one it writes.
    """

    def __init__(self, spec: MambaSpec, block_pool: BlockPool, enable_caching: bool, group_id: int = 0):
        self.null_block = required_null_block(block_pool, "a Mamba group")
        super().__init__(spec, block_pool, enable_caching, group_id)
        # per request: the positions of blocks that an earlier step ended exactly at the end of (their state is the
        # block's; cached once the block's hash is known), and the one the step being planned ends at
        self.req_to_whole_states: defaultdict[str, set[int]] = defaultdict(set)
        self.req_to_planned_whole_state: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        held = len(self.req_to_blocks[request_id]) or len(new_computed_blocks)
        num_new = int(-(-num_tokens // self.block_size) > held)
        evictable_hit = bool(new_computed_blocks) and new_computed_blocks[-1].ref_cnt == 0
        return num_new + int(evictable_hit)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        position = -(-num_tokens // self.block_size) - 1  # the block of the step's last token
        if self.enable_caching and num_tokens % self.block_size == 0:
            self.req_to_planned_whole_state[request_id] = position
        if position < len(blocks):
            return []
        (block,) = self.block_pool.get_new_blocks(1)
        new_blocks = [self.null_block] * (position - len(blocks)) + [block]
        blocks.extend(new_blocks)
        self._held(1)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the held blocks that earlier steps left a whole block's state in, once their hashes are known."""
        planned = self.req_to_planned_whole_state.pop(request_id, None)
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks[request_id]
        whole = self.req_to_whole_states[request_id]
        known = min(num_tokens // self.block_size, len(block_hashes))
        for position in [p for p in whole if p < known]:
            if self._is_real(blocks[position]):
                self.block_pool.cache_full_blocks(blocks, block_hashes, position, position + 1, self.group_id)
            whole.discard(position)
        if planned is not None:
            whole.add(planned)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every block before the one holding the state after ``num_computed_tokens`` tokens (this step's
        source)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or num_computed_tokens == 0:
            return
        source = (num_computed_tokens - 1) // self.block_size
        removed = []
        for position in range(min(source, len(blocks)) - 1, -1, -1):
            block = blocks[position]
            if not self._is_real(block):
                continue
            removed.append(block)
            blocks[position] = self.null_block
            self.req_to_whole_states[request_id].discard(position)
        if removed:
            self._held(-len(removed))
            self.block_pool.free_blocks(removed)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.req_to_whole_states.pop(request_id, None)
        self.req_to_planned_whole_state.pop(request_id, None)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """The longest prefix of whole blocks whose last block's state is cached (null blocks before it)."""
        for length in range(min(max_length // self.block_size, len(block_hashes)), 0, -1):
            block = self.block_pool.get_cached_block(block_hashes[length - 1], self.group_id)
            if block is not None:
                return [self.null_block] * (length - 1) + [block]
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
