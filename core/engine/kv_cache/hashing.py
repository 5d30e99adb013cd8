"""Prefix-cache block hashes: each full block's hash chains its parent's, its tokens and extra keys."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Optional, Sequence

BlockHash = bytes


def hash_block_tokens(
    parent_hash: Optional[BlockHash], token_ids: Sequence[int], extra_keys: Optional[tuple[Any, ...]] = None
) -> BlockHash:
    """sha256 over (parent hash, the block's token ids, extra keys such as a cache salt)."""
    payload = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


def prefix_extra_keys(
    cache_salt: Optional[str] = None, lora: Optional[tuple[str, int]] = None
) -> Optional[tuple[Any, ...]]:
    """What the first block's hash carries besides tokens: the cache salt and the LoRA adapter's (name, id) (a
    block computed with one adapter is never a hit for another, nor for the base model, nor for an adapter loaded
    again under the same name); None when neither is set."""
    if lora is None:
        return None if cache_salt is None else (cache_salt,)
    return (cache_salt, ("lora", *lora))


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: Optional[str] = None,
    lora: Optional[tuple[str, int]] = None,
) -> None:
    """Append the hashes of blocks that became full since the last call.

    The cache salt and the adapter's name enter the first block only (every later hash chains it), so requests
    with different salts or adapters share nothing.
    """
    start = len(block_hashes)
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    first_keys = prefix_extra_keys(cache_salt, lora)
    for index in range(start, num_full):
        extra = first_keys if index == 0 else None
        parent = hash_block_tokens(parent, token_ids[index * block_size : (index + 1) * block_size], extra)
        block_hashes.append(parent)
