"""KVCacheCoordinator interface: how the KV-cache groups of a model share one BlockPool."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
    from engine.kv_cache.spec import KVCacheConfig

# blocks per KV-cache group: blocks[g] is the list of group g's blocks
GroupBlocks = list[list["KVCacheBlock"]]


class KVCacheCoordinator(Pluggable):
    """Allocates, caches and frees the blocks of every KV-cache group for each request.

    Block lists are per group: ``blocks[g]`` is the list of KVCacheBlocks of group ``g``.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool, enable_caching: bool, max_model_len: int):
        self.kv_cache_config = kv_cache_config
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> tuple[GroupBlocks, int]:
        """Blocks of the longest cached prefix (at most ``max_length`` tokens) and its length."""

    @abstractmethod
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks) -> int:
        """Free blocks needed to hold ``num_tokens`` tokens of this request."""

    @abstractmethod
    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks) -> None:
        """Take the prefix-cache hit blocks into the request (ref counts go up)."""

    @abstractmethod
    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        """Grow the request to hold ``num_tokens`` tokens; return only the new blocks per group."""

    @abstractmethod
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Register the request's full blocks (up to ``num_computed_tokens``) in the prefix cache."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool."""

    @abstractmethod
    def get_blocks(self, request_id: str) -> GroupBlocks: ...

    def empty_blocks(self) -> GroupBlocks:
        """No blocks, in the per-group shape (what a request without a prefix hit gets)."""
        return [[] for _ in self.kv_cache_config.groups]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks that no future token can attend to (sliding windows); nothing by default."""
