"""Built-in KV-cache coordinators, registered through the KVCacheCoordinator hook."""

from __future__ import annotations

from typing import Sequence

from engine.hookspecs import hookimpl
from engine.interfaces.base import SelectionContext
from engine.interfaces.kv_cache import KVCacheCoordinator
from engine.kv_cache.single_type_manager import manager_for_spec


class GroupedKVCacheCoordinator(KVCacheCoordinator):
    """Runs one SingleTypeKVCacheManager per group over the shared pool; subclasses decide hits."""

    def __init__(self, kv_cache_config, block_pool, enable_caching: bool, max_model_len: int):
        super().__init__(kv_cache_config, block_pool, enable_caching, max_model_len)
        self.managers = [
            manager_for_spec(group.spec, block_pool, enable_caching, group_id)
            for group_id, group in enumerate(kv_cache_config.groups)
        ]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks):
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, hits)
            for m, hits in zip(self.managers, new_computed_blocks)
        )

    def save_new_computed_blocks(self, request_id, new_computed_blocks):
        for manager, hits in zip(self.managers, new_computed_blocks):
            manager.save_new_computed_blocks(request_id, hits)

    def allocate_new_blocks(self, request_id, num_tokens):
        return [m.allocate_new_blocks(request_id, num_tokens) for m in self.managers]

    def cache_blocks(self, request, num_computed_tokens):
        for manager in self.managers:
            manager.cache_blocks(request.request_id, request.block_hashes, num_computed_tokens)

    def free(self, request_id):
        for manager in self.managers:
            manager.free(request_id)

    def get_blocks(self, request_id):
        return [list(m.req_to_blocks.get(request_id, [])) for m in self.managers]

    def remove_skipped_blocks(self, request_id, num_computed_tokens):
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def empty_blocks(self) -> list[list]:
        return [[] for _ in self.managers]


class NoPrefixCacheCoordinator(GroupedKVCacheCoordinator):
    """Any number of groups, no prefix caching: every prompt is computed in full."""

    name = "no_prefix"
    priority = 10

    def __init__(self, kv_cache_config, block_pool, enable_caching, max_model_len):
        super().__init__(kv_cache_config, block_pool, False, max_model_len)

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        return not ctx.config.cache.enable_prefix_caching

    def find_longest_cache_hit(self, block_hashes: Sequence, max_length: int):
        return self.empty_blocks(), 0

    def cache_blocks(self, request, num_computed_tokens):
        """Nothing is ever cached."""


class UnitaryKVCacheCoordinator(GroupedKVCacheCoordinator):
    """Exactly one KV-cache group (every layer alike), with prefix caching."""

    name = "unitary"
    priority = 20

    @classmethod
    def unavailable_reasons(cls, ctx: SelectionContext) -> list[str]:
        groups = ctx.num_kv_cache_groups
        if groups is not None and groups != 1:
            return [f"the model has {groups} KV-cache groups; unitary serves exactly one (use hybrid)"]
        return []

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        return ctx.config.cache.enable_prefix_caching

    def find_longest_cache_hit(self, block_hashes: Sequence, max_length: int):
        hits = self.managers[0].find_longest_cache_hit(block_hashes, max_length)
        return [hits], len(hits) * self.managers[0].block_size


class HybridKVCacheCoordinator(GroupedKVCacheCoordinator):
    """Several KV-cache groups (e.g. sliding-window and full-attention layers, or Mamba and attention layers) over one
    BlockPool.

    A prefix hit is the longest length every group can serve: full attention needs every block of the
    prefix, a sliding-window group only the blocks under the window of the first recomputed token, a Mamba group
    only the prefix's last block (the state after it). Sliding-window groups free the blocks that slid out of the
    window as the request advances; Mamba groups free the block behind the running state.
    """

    name = "hybrid"
    priority = 30

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        groups = ctx.num_kv_cache_groups
        return ctx.config.cache.enable_prefix_caching and (groups is None or groups > 1)

    def find_longest_cache_hit(self, block_hashes: Sequence, max_length: int):
        block_size = self.managers[0].block_size
        length = max_length // block_size * block_size
        while True:  # each group's answer can only shorten the others'; stop when all agree
            hits = [manager.find_longest_cache_hit(block_hashes, length) for manager in self.managers]
            agreed = min(len(h) for h in hits) * block_size
            if agreed == length:
                return hits, length
            length = agreed


@hookimpl
def engine_kv_cache_coordinators():
    return [NoPrefixCacheCoordinator, UnitaryKVCacheCoordinator, HybridKVCacheCoordinator]
