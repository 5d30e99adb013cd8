"""Writing new K/V into the default paged layout ([2, blocks, block_size, kv_heads, head_size])."""

from __future__ import annotations

import torch


def write_to_paged_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key / value [T, Hkv, D] go to flat slots ``slot_mapping`` [T] of the K and V halves (rounded to the cache's
    dtype where it is narrower: cache.kv_cache_dtype)."""
    kv_heads, head = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, kv_heads, head).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, kv_heads, head).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
