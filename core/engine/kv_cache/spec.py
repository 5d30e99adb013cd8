"""KV-cache specs per layer, grouping into KV-cache groups, and the block count from a memory budget."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from engine.config import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that attends to every earlier token."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * torch.empty((), dtype=self.dtype).element_size()

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer that attends to the last ``sliding_window`` tokens only."""

    sliding_window: int = 0


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table."""

    layer_names: tuple[str, ...]
    spec: FullAttentionSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks the pool holds and how layers group onto them."""

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    def group_of_layer(self) -> dict[str, int]:
        return {name: g for g, group in enumerate(self.groups) for name in group.layer_names}


def group_layers(specs: dict[str, FullAttentionSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Layers with equal specs form one group, in first-seen order."""
    by_spec: dict[FullAttentionSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    return tuple(KVCacheGroupSpec(tuple(names), spec) for spec, names in by_spec.items())


def make_kv_cache_config(specs: dict[str, FullAttentionSpec], memory_bytes: int,
                         num_blocks_override: Optional[int], max_model_len: int) -> KVCacheConfig:
    """Size the pool: every layer holds ``num_blocks`` blocks, so a block costs the sum of all pages."""
    groups = group_layers(specs)
    bytes_per_block = sum(spec.page_size_bytes for spec in specs.values())
    num_blocks = num_blocks_override or memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(f"cache.kv_cache_memory={memory_bytes} bytes holds no KV block "
                         f"(one block costs {bytes_per_block} bytes over all layers)")
    block_size = groups[0].spec.block_size
    if num_blocks * block_size < max_model_len:
        raise ConfigError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), "
            f"fewer than one request of the context length model.max_model_len={max_model_len} may need; "
            "raise cache.kv_cache_memory (or cache.num_gpu_blocks_override) or lower model.max_model_len")
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %d group(s)); one request may "
                "use up to %d tokens", num_blocks, block_size, num_blocks * block_size,
                num_blocks * bytes_per_block / 2**20, len(groups), max_model_len)
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)
