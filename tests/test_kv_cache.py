"""BlockPool, prefix hashes and KVCacheManager with the built-in coordinators."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.coordinators import HybridKVCacheCoordinator, NoPrefixCacheCoordinator, UnitaryKVCacheCoordinator
from engine.kv_cache.hashing import extend_block_hashes, hash_block_tokens
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from engine.sampling_params import SamplingParams
from engine.scheduler.request import Request

BS = 4


def kv_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(BS, 2, 8, torch.float32)
    return KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l0", "l1"), spec),))


def make_request(rid: str, tokens: list[int], salt=None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), eos_token_id=None, block_size=BS, cache_salt=salt)


def test_block_pool_lru_and_ref_counts():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 2 and a.ref_cnt == 1
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b, a])  # b freed first: evicted first
    assert list(pool.free_queue)[-2:] == [b.block_id, a.block_id]
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])


def test_hashes_chain_and_salt_separates():
    tokens = list(range(10))
    plain, salted = [], []
    extend_block_hashes(plain, tokens, BS)
    extend_block_hashes(salted, tokens, BS, cache_salt="tenant-a")
    assert len(plain) == 2  # only full blocks
    assert plain[1] == hash_block_tokens(plain[0], tokens[4:8])
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt poisons the whole chain
    other = []
    extend_block_hashes(other, [99] + tokens[1:], BS)
    assert other[1] != plain[1]  # same second block, different parent


def test_prefix_hit_shares_blocks_and_counts_stats():
    manager = KVCacheManager(kv_config(16), UnitaryKVCacheCoordinator, max_model_len=64, enable_caching=True)
    first = make_request("a", list(range(10)))
    hits, n = manager.get_computed_blocks(first)
    assert n == 0
    assert manager.allocate_slots(first, 10, hits, n) is not None
    first.num_computed_tokens = 10
    second = make_request("b", list(range(9)) + [77, 78])
    hits, n = manager.get_computed_blocks(second)
    assert n == 8 and hits.get_block_ids()[0] == manager.get_block_ids("a")[0][:2]
    manager.allocate_slots(second, 3, hits, n)
    assert hits.blocks[0][0].ref_cnt == 2
    assert manager.prefix_cache_stats.hits == 8 and manager.prefix_cache_stats.queries == 21
    manager.free(first)
    manager.free(second)
    assert manager.block_pool.get_num_free_blocks() == 16
    # freed blocks stay findable until evicted
    third = make_request("c", list(range(9)))
    assert manager.get_computed_blocks(third)[1] == 8


def test_last_token_is_never_a_hit():
    manager = KVCacheManager(kv_config(8), UnitaryKVCacheCoordinator, max_model_len=64, enable_caching=True)
    first = make_request("a", list(range(8)))
    manager.allocate_slots(first, 8)
    assert manager.get_computed_blocks(make_request("b", list(range(8))))[1] == 4


def test_a_slot_for_a_token_not_yet_sampled_is_never_cached():
    """With async scheduling a step may schedule the position of a token still being sampled; the block that
    slot completes must not enter the prefix cache, since its last token is unknown."""
    manager = KVCacheManager(kv_config(8), UnitaryKVCacheCoordinator, max_model_len=64, enable_caching=True)
    request = make_request("a", list(range(7)))  # block 0 full, block 1 holds 3 tokens
    manager.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    manager.allocate_slots(request, 1)  # position 7: the token that the step in flight will sample
    blocks = manager.coordinator.get_blocks("a")[0]
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None
    assert manager.get_computed_blocks(make_request("b", list(range(7)) + [99, 5]))[1] == 4


def test_allocation_failure_leaves_pool_untouched():
    manager = KVCacheManager(kv_config(3), UnitaryKVCacheCoordinator, max_model_len=64, enable_caching=True)
    request = make_request("a", list(range(20)))
    assert manager.allocate_slots(request, 20) is None
    assert manager.block_pool.get_num_free_blocks() == 3
    assert manager.allocate_slots(request, 12) is not None
    assert manager.block_pool.get_num_free_blocks() == 0


def test_eviction_reuses_cached_blocks_oldest_first():
    manager = KVCacheManager(kv_config(4), UnitaryKVCacheCoordinator, max_model_len=64, enable_caching=True)
    old = make_request("old", list(range(8)))
    manager.allocate_slots(old, 8)
    manager.free(old)
    new = make_request("new", list(range(100, 116)))
    manager.allocate_slots(new, 16)
    assert manager.block_pool.num_evictions == 2
    assert manager.get_computed_blocks(make_request("x", list(range(9))))[1] == 0


def test_no_prefix_coordinator_never_hits():
    manager = KVCacheManager(kv_config(8), NoPrefixCacheCoordinator, max_model_len=64, enable_caching=True)
    first = make_request("a", list(range(10)))
    manager.allocate_slots(first, 10)
    assert manager.get_computed_blocks(make_request("b", list(range(10))))[1] == 0
    assert not manager.block_pool.cached_block_hash_to_block


def test_block_count_from_memory_budget():
    spec = FullAttentionSpec(16, 3, 64, torch.float32)  # 2*16*3*64*4 = 24576 bytes per layer
    config = make_kv_cache_config({f"l{i}": spec for i in range(30)}, 30 * 24576 * 100, None, 1600)
    assert config.num_blocks == 100 and len(config.groups) == 1
    assert make_kv_cache_config({"l": spec}, 10**9, 7, 100).num_blocks == 7
    with pytest.raises(ValueError, match="fewer than one request of the context length"):
        make_kv_cache_config({"l": spec}, 10**9, 7, 8192)
    with pytest.raises(ValueError, match="holds no KV block"):
        make_kv_cache_config({"l": spec}, 100, None, 16)


def hybrid_config(num_blocks: int, window: int) -> KVCacheConfig:
    full = FullAttentionSpec(BS, 2, 8, torch.float32)
    sliding = SlidingWindowSpec(BS, 2, 8, torch.float32, sliding_window=window)
    return KVCacheConfig(num_blocks, (KVCacheGroupSpec(("s0",), sliding), KVCacheGroupSpec(("f0",), full)))


def advance(manager, request, num_tokens):
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens


def test_sliding_window_group_frees_blocks_that_slid_out():
    manager = KVCacheManager(hybrid_config(40, window=6), HybridKVCacheCoordinator, 64, enable_caching=True)
    pool = manager.block_pool
    assert pool.null_block is not None and pool.num_usable_blocks == 39
    request = make_request("a", list(range(30)))
    advance(manager, request, 30)  # one prefill chunk needs all 8 blocks in both groups
    assert manager.group_block_usage() == [(8, 8), (8, 8)]
    advance(manager, request, 0)  # the next step's keys start at position 30 - 6 + 1 = 25: block 6 on
    sliding_ids, full_ids = manager.get_block_ids("a")
    assert sliding_ids[:6] == [pool.null_block.block_id] * 6 and len(full_ids) == 8
    assert manager.group_block_usage()[0] == (2, 8)
    assert pool.get_num_free_blocks() == 39 - 10
    manager.free(request)
    assert pool.get_num_free_blocks() == 39 and manager.group_block_usage() == [(0, 8), (0, 8)]


def test_hybrid_hit_is_the_longest_length_every_group_serves():
    manager = KVCacheManager(hybrid_config(40, window=6), HybridKVCacheCoordinator, 64, enable_caching=True)
    tokens = list(range(100, 126))  # 6 full blocks + 2
    first = make_request("a", tokens)
    advance(manager, first, 26)
    manager.free(first)
    # same prompt: full attention could serve 6 blocks; sliding needs the last ceil(5/4)=2 blocks before it
    blocks, hit = manager.get_computed_blocks(make_request("b", tokens))
    assert hit == 24 and len(blocks.blocks[0]) == len(blocks.blocks[1]) == 6
    assert blocks.blocks[0][:4] == [manager.block_pool.null_block] * 4  # the sliding group skips what it never reads
    # evict the sliding group's block 5: the hit falls back to the longest length both groups still serve
    pool = manager.block_pool
    evicted = pool.get_cached_block(first.block_hashes[5], group_id=0)
    del pool.cached_block_hash_to_block[evicted.block_hash]
    evicted.block_hash = None
    blocks, hit = manager.get_computed_blocks(make_request("c", tokens))
    assert hit == 20 and [len(b) for b in blocks.blocks] == [5, 5]
    second = make_request("d", tokens)
    blocks, hit = manager.get_computed_blocks(second)
    assert manager.allocate_slots(second, 26 - hit, blocks, hit) is not None
    manager.free(second)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_groups_never_share_prefix_cache_entries():
    manager = KVCacheManager(hybrid_config(40, window=6), HybridKVCacheCoordinator, 64, enable_caching=True)
    request = make_request("a", list(range(12)))
    advance(manager, request, 12)
    keys = set(manager.block_pool.cached_block_hash_to_block)
    assert {group for _, group in keys} == {0, 1} and len(keys) == 6
