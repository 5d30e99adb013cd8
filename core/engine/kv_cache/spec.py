"""KV-cache specs per layer, grouping into KV-cache groups, and the block count from a memory budget."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from engine.config import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer keeps per request in the paged cache: pages of ``page_size_bytes`` each."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A layer that attends to every earlier token."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer (K and V)."""
        return (
            2 * self.block_size * self.num_kv_heads * self.head_size * torch.empty((), dtype=self.dtype).element_size()
        )


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer that attends to the last ``sliding_window`` tokens only."""

    sliding_window: int = 0


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """A multi-head latent attention layer: one latent row per token (``num_kv_heads`` 1, ``head_size`` the latent
    plus the rotary part), not a key and a value per head."""

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A state-space (Mamba) layer: a constant-size state per request (the convolution's last inputs and the SSM
    state), held in one block whatever the context length (two while a step moves it into the block of its last
    token: see ``MambaManager``). ``shapes`` are the state tensors' shapes, all of
    ``dtype``; ``page_size_padded`` raises the page to the attention layers' so both kinds share cache tensors."""

    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: torch.dtype = torch.float32
    page_size_padded: int = 0

    @property
    def state_size_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) for shape in self.shapes) * element

    @property
    def page_size_bytes(self) -> int:
        return max(self.state_size_bytes, self.page_size_padded)

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return 2


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks the pool holds, how layers group onto block tables, and which layers share memory.

    ``tensors`` lists the layers that share one cache tensor: at most one layer of each group, so a block
    id (owned by exactly one group at a time) never holds two layers' data at once.
    """

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]
    tensors: tuple[tuple[str, ...], ...] = ()

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def needs_null_block(self) -> bool:
        return needs_null_block(self.groups)

    def shared_tensors(self) -> tuple[tuple[str, ...], ...]:
        """Layer names per cache tensor (one layer per tensor when no sharing was planned)."""
        return self.tensors or tuple((name,) for group in self.groups for name in group.layer_names)


def needs_null_block(groups: tuple[KVCacheGroupSpec, ...]) -> bool:
    """Whether some group's block lists have positions without a block (slid out of a window, or behind a Mamba
    state): the pool's null block stands there."""
    return any(isinstance(group.spec, (SlidingWindowSpec, MambaSpec)) for group in groups)


def unify_page_sizes(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Hybrid models (vLLM's page-size unification): raise the attention layers' block size by a whole factor until
    one attention page holds a Mamba state, then pad the Mamba pages to the attention page, so that every layer's
    page is one size and the layers of different kinds share cache tensors. Other models are returned as given."""
    mamba = [spec for spec in specs.values() if isinstance(spec, MambaSpec)]
    attention = [spec for spec in specs.values() if not isinstance(spec, MambaSpec)]
    if not mamba:
        return specs
    state_bytes = max(spec.state_size_bytes for spec in mamba)
    if not attention:
        return {
            name: replace(spec, page_size_padded=state_bytes)
            for name, spec in specs.items()
            if isinstance(spec, MambaSpec)
        }
    old_block = max(spec.block_size for spec in attention)
    factor = -(-state_bytes // min(spec.page_size_bytes for spec in attention))
    resized = {name: replace(spec, block_size=spec.block_size * factor) for name, spec in specs.items()}
    page = max(spec.page_size_bytes for spec in resized.values() if not isinstance(spec, MambaSpec))
    unified = {
        name: replace(spec, page_size_padded=page) if isinstance(spec, MambaSpec) else spec
        for name, spec in resized.items()
    }
    if factor > 1:
        logger.info(
            "hybrid model: attention block size raised from %d to %d tokens so that one page (%d bytes) holds a "
            "Mamba layer's state (%d bytes)",
            old_block,
            old_block * factor,
            page,
            state_bytes,
        )
    return unified


def group_layers(specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Group layers by spec, then split each kind into groups of equal size (vLLM's hybrid layout).

    With one kind every layer is one group. With several kinds of equal page size, each kind is cut into
    groups of as many layers as the rarest kind has, so that groups can share cache tensors layer for
    layer (e.g. Gemma 3, 5 sliding : 1 full, gives groups of the full-layer count).
    """
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    if len(by_spec) == 1 or len({spec.page_size_bytes for spec in by_spec}) > 1:
        return tuple(KVCacheGroupSpec(tuple(names), spec) for spec, names in by_spec.items())
    size = min(len(names) for names in by_spec.values())
    return tuple(
        KVCacheGroupSpec(tuple(names[i : i + size]), spec)
        for spec, names in by_spec.items()
        for i in range(0, len(names), size)
    )


def plan_shared_tensors(groups: tuple[KVCacheGroupSpec, ...]) -> tuple[tuple[str, ...], ...]:
    """The k-th layer of every group shares tensor k (only when all pages are the same size)."""
    if len({group.spec.page_size_bytes for group in groups}) > 1:
        return tuple((name,) for group in groups for name in group.layer_names)
    width = max(len(group.layer_names) for group in groups)
    return tuple(tuple(group.layer_names[k] for group in groups if k < len(group.layer_names)) for k in range(width))


def make_kv_cache_config(
    specs: dict[str, KVCacheSpec],
    memory_bytes: int,
    num_blocks_override: Optional[int],
    max_model_len: int,
    stage_layers: Optional[list[set[str]]] = None,
) -> KVCacheConfig:
    """Size the pool: a block id costs one page in every cache tensor. With pipeline parallelism
    (``stage_layers``: the layer names each stage holds), each worker holds only its stage's tensors and
    ``memory_bytes`` is each worker's budget: the stage with the most bytes per block sets the count."""
    specs = unify_page_sizes(specs)
    groups = group_layers(specs)
    tensors = plan_shared_tensors(groups)
    stages = stage_layers or [set(specs)]
    # a shared tensor lives on every stage holding one of its layers
    bytes_per_block = max(
        sum(specs[names[0]].page_size_bytes for names in tensors if layers.intersection(names)) for layers in stages
    )
    num_blocks = num_blocks_override or memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"cache.kv_cache_memory={memory_bytes} bytes holds no KV block "
            f"(one block costs {bytes_per_block} bytes over a worker's layers)"
        )
    block_size = groups[0].spec.block_size
    # every group needs its own blocks for a request (a sliding group, too, while it prefills a long chunk)
    needed = sum(group.spec.max_blocks_per_request(max_model_len) for group in groups) + int(needs_null_block(groups))
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens, fewer than one request of the "
            f"context length model.max_model_len={max_model_len} may need ({needed} blocks over "
            f"{len(groups)} KV-cache group(s)); raise cache.kv_cache_memory (or cache.num_gpu_blocks_override) "
            "or lower model.max_model_len"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB per worker%s; %d group(s) over %d shared tensor(s)); "
        "one request may use up to %d tokens",
        num_blocks,
        block_size,
        num_blocks * bytes_per_block / 2**20,
        f", {len(stages)} pipeline stages" if len(stages) > 1 else "",
        len(groups),
        len(tensors),
        max_model_len,
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=tensors)
