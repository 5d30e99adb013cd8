"""KVCacheManager: the scheduler's view of the paged cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from engine.kv_cache.spec import KVCacheConfig, MambaSpec

logger = logging.getLogger(__name__)


@dataclass
class KVCacheBlocks:
    """The blocks the KVCacheManager hands the scheduler: ``blocks[g]`` are the blocks of KV-cache group
    ``g``. The scheduler reads block ids through ``get_block_ids``, never the block objects."""

    blocks: list[list[KVCacheBlock]]

    def get_block_ids(self) -> list[list[int]]:
        return [[block.block_id for block in group] for group in self.blocks]


class KVCacheManager:
    """Finds prefix hits, allocates slots for scheduled tokens and frees finished requests."""

    def __init__(self, kv_cache_config: KVCacheConfig, coordinator_cls: type, max_model_len: int, enable_caching: bool):
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(kv_cache_config.num_blocks, reserve_null_block=kv_cache_config.needs_null_block)
        self.coordinator = coordinator_cls(kv_cache_config, self.block_pool, enable_caching, max_model_len)
        self.enable_caching = self.coordinator.enable_caching
        self.prefix_cache_stats = PrefixCacheStats()
        # Mamba states are cached only where a step ends at a block boundary: prefill chunks are cut there
        self.aligns_chunks = self.enable_caching and any(isinstance(g.spec, MambaSpec) for g in kv_cache_config.groups)
        if self.aligns_chunks:
            logger.info(
                "prefix caching with Mamba layers: a request's Mamba states are cached where a step ends at a "
                "%d-token block boundary (prefill chunks are cut there; decode passes every one)",
                self.block_size,
            )

    @property
    def usage(self) -> float:
        """The share of usable blocks in use (0-1)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def get_computed_blocks(self, request) -> tuple[KVCacheBlocks, int]:
        """Cached blocks of the request's longest known prefix, and how many tokens they hold.

        The last prompt token is always recomputed: its logits are needed to sample.
        """
        if not self.enable_caching or request.sampling_params.skip_prefix_cache:
            return KVCacheBlocks(self.coordinator.empty_blocks()), 0
        max_length = request.num_tokens - 1
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return KVCacheBlocks(blocks), num_hit_tokens

    def align_num_new_tokens(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """How many of ``num_new_tokens`` to schedule so that a hybrid model's prefill leaves cacheable Mamba states
        (with prefix caching; otherwise all of them). A chunk that stops short of the request's known tokens is cut
        back to a block boundary, and the chunk that reaches them stops at their last boundary before the final
        token (the rest runs in the next step), so that the prompt's last whole block can be hit by a request that
        repeats it. A cut that would leave nothing is not made."""
        if not self.aligns_chunks or num_new_tokens <= 1:
            return num_new_tokens
        end = num_computed_tokens + num_new_tokens
        if end < request.num_tokens:
            boundary = end // self.block_size * self.block_size
        else:
            boundary = (request.num_tokens - 1) // self.block_size * self.block_size
        return boundary - num_computed_tokens if boundary > num_computed_tokens else num_new_tokens

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_new_computed_tokens: int = 0,
    ) -> Optional[KVCacheBlocks]:
        """Make room for ``num_new_tokens`` more tokens; None when the pool cannot (caller preempts)."""
        hit_blocks = self.coordinator.empty_blocks() if new_computed_blocks is None else new_computed_blocks.blocks
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed + num_new_tokens, self.max_model_len)
        self.coordinator.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        needed = self.coordinator.get_num_blocks_to_allocate(request.request_id, num_tokens_need_slot, hit_blocks)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if self.enable_caching:
            for hits in hit_blocks:
                self.block_pool.touch(hits)
        self.coordinator.save_new_computed_blocks(request.request_id, hit_blocks)
        new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)
        if self.enable_caching:
            # Only tokens whose ids are known can be cached (not the slot of a token yet to be sampled).
            self.coordinator.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def free(self, request) -> None:
        self.coordinator.free(request.request_id)

    def group_block_usage(self) -> list[tuple[int, int]]:
        """(blocks held now, peak blocks held) for each KV-cache group."""
        managers = getattr(self.coordinator, "managers", [])  # a third-party coordinator may keep no managers
        return [(m.num_held_blocks, m.peak_held_blocks) for m in managers]

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Every block id of the request, per KV-cache group."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id)).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
