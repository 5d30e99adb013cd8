"""The C++ decode kernel of the ``cpu`` attention plugin against a plain softmax(qK^T)V, across the shapes
its vector paths split on: query heads per KV head (chunks of 1-3), head sizes that take the 32-column,
16-column and scalar paths, scattered blocks, sliding windows and soft-capping."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine_attention_cpu._C") is None, reason="the cpu attention kernel is not built"
)


def reference(q, keys, values, scale, cap):
    """q [H, D]; keys/values [n, Hkv, D] -> [H, D] in float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q.double(), k) * scale
    if cap:
        scores = cap * torch.tanh(scores / cap)
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), v)


def scattered_block_table(lens: torch.Tensor, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each row's blocks at shuffled places of a cache of ``num_blocks`` (block 0 unused): (table, num_blocks)."""
    blocks_per_row = (lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_row.sum()) + 1
    order = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32) + 1
    table = torch.zeros(len(lens), int(blocks_per_row.max()), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks_per_row.tolist()):
        table[row, :count] = order[start : start + count]
        start += count
    return table, num_blocks


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2), (4, 1), (5, 1), (8, 1), (16, 2)])
@pytest.mark.parametrize("head_size", [64, 48, 80, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_kernel_matches_softmax_attention(num_heads, num_kv_heads, head_size, dtype):
    from engine_attention_cpu import _C

    gen = torch.Generator().manual_seed(num_heads * 100 + head_size)
    block_size = 16
    # 600 and 257 run in parts of 256 positions (the last one short), merged by their softmax peaks and sums
    lens = torch.tensor([1, 7, 16, 33, 150, 257, 600], dtype=torch.int32)
    rows = len(lens)
    table, num_blocks = scattered_block_table(lens, block_size, gen)
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    key_cache, value_cache = cache[0].transpose(1, 2), cache[1].transpose(1, 2)  # head-major, seen token-major
    q = torch.randn(rows, num_heads, head_size, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_size)
    for window, cap in [(0, 0.0), (20, 0.0), (0, 5.0), (300, 0.0)]:
        out = torch.empty_like(q)
        _C.paged_decode_attention(out, q, key_cache, value_cache, table, lens, scale, cap, window)
        for row in range(rows):
            n = int(lens[row])
            positions = torch.arange(max(0, n - window) if window else 0, n)
            slots = table[row][positions // block_size].long()
            keys = key_cache[slots, positions % block_size]
            values = value_cache[slots, positions % block_size]
            expected = reference(q[row], keys, values, scale, cap)
            tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out[row].double(), expected, **tol)


@pytest.mark.parametrize("rows", [1, 9], ids=["heads-split-over-items", "whole-requests"])
@pytest.mark.parametrize("num_heads", [16, 5, 1])
@pytest.mark.parametrize("latent,rank", [(576, 512), (40, 32), (20, 12)], ids=["deepseek", "tiny", "scalar-tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_decode_kernel_matches_softmax_over_latents(rows, num_heads, latent, rank, dtype):
    """csrc/mla_decode.cpp: every head over the same paged latent rows, values their first ``rank`` columns; few
    requests split their heads over work items, many run whole; head counts off the 4-head tile, latent sizes off the
    vector width."""
    from engine_attention_cpu import _mla

    gen = torch.Generator().manual_seed(rows * num_heads + latent)
    block_size, num_blocks = 16, 96
    lens = torch.randint(1, 130, (rows,), generator=gen, dtype=torch.int32)
    table = torch.randperm(num_blocks, generator=gen)[: rows * 9].view(rows, 9).to(torch.int32).contiguous()
    cache = torch.randn(num_blocks, block_size, latent, generator=gen).to(dtype)
    query = torch.randn(rows, num_heads, latent, generator=gen).to(dtype)
    out = torch.empty(rows, num_heads, rank, dtype=dtype)
    scale = 0.1
    _mla.mla_decode_attention(out, query, cache, table, lens, scale)
    for r in range(rows):
        rows_of_r = cache[table[r].long()].reshape(-1, latent)[: int(lens[r])].double()
        p = (query[r].double() @ rows_of_r.T * scale).softmax(-1)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[r].double(), p @ rows_of_r[:, :rank], atol=tolerance, rtol=tolerance)


def _attention_modules():
    """(name, module, variant) for every ISA variant of the decode loops this machine can run: natively, and the
    AVX-512 one over SIMDe where the emulated build exists (CPUs without AVX-512)."""
    from engine_attention_cpu import _C

    found = [(f"native-{name}", _C, index) for index, (name, runs) in enumerate(_C.variants()) if runs]
    if importlib.util.find_spec("engine_attention_cpu._C_emulated") is not None:
        from engine_attention_cpu import _C_emulated

        found.append(("simde-avx512", _C_emulated, [n for n, _ in _C_emulated.variants()].index("avx512")))
    return found


@pytest.mark.parametrize(
    "head_size,value_size", [(64, 64), (128, 128), (80, 80), (96, 96), (48, 48), (112, 112), (576, 512)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_every_isa_variant_gives_the_avx2_variants_bits(head_size, value_size, dtype):
    """The loops are one source compiled per ISA (attention_rows.inc): the AVX-512 variant takes 64 columns a pass
    over the value rows where AVX2 takes 32, with the same multiply-add chain per element, so the bits agree for
    every split of the head into passes (64 = 1 or 2 passes, 80 = 64 + 16, 96 = 64 + 32, 112 = 64 + 32 + 16, and
    MLA's 576-wide keys with 512-wide values). Where the CPU lacks AVX-512, its code runs over SIMDe."""
    from engine_attention_cpu import _C

    modules = _attention_modules()
    if not any(name.endswith("avx512") for name, _, _ in modules):
        pytest.skip("neither AVX-512 nor the SIMDe build (cmeel-simde) is here")
    gen = torch.Generator().manual_seed(head_size)
    block_size, num_heads, num_kv_heads = 16, 6, 2
    lens = torch.tensor([1, 9, 16, 47, 200, 520], dtype=torch.int32)
    rows = len(lens)
    table, num_blocks = scattered_block_table(lens, block_size, gen)
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    key_cache = cache[0].transpose(1, 2)
    value_cache = cache[1].transpose(1, 2)[..., :value_size]
    q = torch.randn(rows, num_heads, head_size, generator=gen).to(dtype)
    for window, cap in [(0, 0.0), (20, 0.0), (0, 5.0)]:
        expected = torch.empty(rows, num_heads, value_size, dtype=dtype)
        _C.paged_decode_attention(expected, q, key_cache, value_cache, table, lens, 0.125, cap, window, variant=0)
        for name, module, variant in modules:
            out = torch.empty_like(expected)
            module.paged_decode_attention(
                out, q, key_cache, value_cache, table, lens, 0.125, cap, window, variant=variant
            )
            assert torch.equal(out, expected), (name, window, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_requests_bits_depend_neither_on_its_batch_nor_on_the_threads(dtype):
    """A long context runs in parts (work items of their own, so that one request's KV heads spread over the
    threads) merged by their softmax peaks and sums: the parts follow from the request's own length, never from the
    batch around it, and the merge goes in part order whichever thread finished last. So a request alone, one in a
    batch of others, and either on one thread, give the same bits (model.batch_invariant relies on it)."""
    from engine_attention_cpu import _C

    gen = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, head_size = 16, 9, 3, 64
    lens = torch.tensor([255, 256, 257, 512, 513, 900, 3, 1200], dtype=torch.int32)
    table, num_blocks = scattered_block_table(lens, block_size, gen)
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    key_cache, value_cache = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    q = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)

    def attend(rows: list[int]) -> torch.Tensor:
        out = torch.empty(len(rows), num_heads, head_size, dtype=dtype)
        _C.paged_decode_attention(out, q[rows], key_cache, value_cache, table[rows], lens[rows], 0.125, 0.0, 0)
        return out

    batch = attend(list(range(len(lens))))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = attend(list(range(len(lens))))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, batch)
    for row in range(len(lens)):
        assert torch.equal(attend([row])[0], batch[row]), int(lens[row])
    assert torch.equal(attend([7, 5, 0])[1], batch[5])


def test_a_variant_the_cpu_lacks_is_refused():
    from engine_attention_cpu import _C

    lacking = [index for index, (_, runs) in enumerate(_C.variants()) if not runs]
    q = torch.randn(1, 2, 64)
    cache = torch.randn(2, 1, 16, 1, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    for variant in lacking + [7]:
        with pytest.raises(RuntimeError, match="lacks the instructions of attention variant"):
            _C.paged_decode_attention(
                torch.empty_like(q), q, cache[0], cache[1], table, lens, 0.1, 0.0, 0, variant=variant
            )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16-cache", "fp16-cache"])
@pytest.mark.parametrize("head_size", [64, 48], ids=["vector", "portable"])
def test_a_16_bit_cache_under_float32_queries_reads_as_its_float32_widening(cache_dtype, head_size):
    """cache.kv_cache_dtype: float32 queries over a bfloat16 or float16 cache. The kernel widens each row as it
    reads it and runs the float32 path's sums, so its output is, bit for bit, the float32 kernel's over the same
    rows widened to float32; and write_kv_cache rounds float32 rows into the cache as torch's .to() does. Every ISA
    variant (and the AVX-512 one over SIMDe) agrees."""
    from engine_attention_cpu import _C

    gen = torch.Generator().manual_seed(head_size)
    block_size, num_heads, num_kv_heads = 16, 9, 3
    lens = torch.tensor([1, 16, 33, 257, 600], dtype=torch.int32)
    table, num_blocks = scattered_block_table(lens, block_size, gen)
    cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_size, dtype=cache_dtype)
    key_cache, value_cache = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    # every position's K/V through write_kv_cache (float32 rows, rounded into the 16-bit cache)
    positions = [torch.arange(n) for n in lens.tolist()]
    slots = torch.cat([table[r, p // block_size].long() * block_size + p % block_size for r, p in enumerate(positions)])
    keys = torch.randn(len(slots), num_kv_heads, head_size, generator=gen)
    values = torch.randn(len(slots), num_kv_heads, head_size, generator=gen)
    _C.write_kv_cache(key_cache, value_cache, keys, values, slots)
    flat_keys = key_cache.reshape(-1, num_kv_heads, head_size)[slots]
    assert torch.equal(flat_keys, keys.to(cache_dtype))
    assert torch.equal(value_cache.reshape(-1, num_kv_heads, head_size)[slots], values.to(cache_dtype))

    widened = cache.float()
    wide_keys, wide_values = widened[0].transpose(1, 2), widened[1].transpose(1, 2)
    q = torch.randn(len(lens), num_heads, head_size, generator=gen)
    for window, cap in [(0, 0.0), (20, 0.0), (0, 5.0), (300, 0.0)]:
        expected = torch.empty_like(q)
        _C.paged_decode_attention(expected, q, wide_keys, wide_values, table, lens, 0.125, cap, window)
        for name, module, variant in _attention_modules():
            out = torch.empty_like(q)
            module.paged_decode_attention(out, q, key_cache, value_cache, table, lens, 0.125, cap, window, variant)
            assert torch.equal(out, expected), (name, window, cap)


def test_mixed_dtypes_other_than_a_16_bit_cache_under_float32_queries_are_refused():
    from engine_attention_cpu import _C

    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    wide = torch.zeros(2, 1, 16, 1, 64)
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 / float16 under float32 queries"):
        _C.paged_decode_attention(torch.empty_like(q), q, wide[0], wide[1], table, lens, 0.125, 0.0, 0)
    with pytest.raises(RuntimeError, match="bfloat16 / float16 for float32 rows"):
        rows = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
        _C.write_kv_cache(wide[0], wide[1], rows, rows, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_pure_decode_steps_metadata_is_the_general_paths(batch_invariant):
    """The builder's shortcut for a step of one token per row (max_query_len 1) gives what the general path gives
    for the same rows: every row a decode row, the same table, lengths, slots and token indices, no prompt chunks."""
    import dataclasses

    import numpy as np

    from engine.interfaces.attention import CommonAttentionMetadata
    from engine_attention_cpu.attention import CpuAttentionMetadataBuilder

    seq_lens = np.array([5, 17, 1, 33], dtype=np.int64)
    qsl = np.arange(len(seq_lens) + 1, dtype=np.int64)
    table = torch.arange(4 * 3, dtype=torch.int32).view(4, 3)
    common = CommonAttentionMetadata(
        torch.from_numpy(qsl.astype(np.int32)),
        torch.from_numpy(seq_lens.astype(np.int32)),
        torch.from_numpy((seq_lens - 1).astype(np.int32)),
        table,
        torch.tensor([4, 16 + 16, 0, 2 * 16 + 16], dtype=torch.int64),
        1,
        int(seq_lens.max()),
        qsl,
        seq_lens,
        seq_lens - 1,
    )
    builder = CpuAttentionMetadataBuilder({}, torch.device("cpu"), 16)
    builder.batch_invariant = batch_invariant
    fast = builder.build(common)
    general = builder.build(dataclasses.replace(common, max_query_len=2))  # the shortcut keys on max_query_len
    assert fast.all_decode and general.all_decode and fast.prefills == general.prefills == []
    for field in ("slot_mapping", "decode_token_indices", "decode_block_table", "decode_seq_lens"):
        mine, theirs = getattr(fast, field), getattr(general, field)
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), field
    assert fast.num_actual_tokens == general.num_actual_tokens == 4
