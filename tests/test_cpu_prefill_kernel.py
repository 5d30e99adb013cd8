"""The C++ prompt-attention kernel of the ``cpu`` attention plugin (``csrc/prefill_attention.cpp``): against a
float64 softmax(qK^T)V over the paged cache, across what it splits on (GQA groups, head sizes that take 64-, 32- and
16-column tiles, chunks of 256 keys, windows of packed chunks, cached context before the chunk, sliding windows and
soft caps); every ISA variant's bits; and greedy decoding through it against transformers."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.helpers import assert_all_blocks_free, hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine_attention_cpu._C") is None, reason="the cpu attention kernel is not built"
)


def vector_build() -> bool:
    from engine_attention_cpu import _C

    return any(runs for _, runs in _C.variants())


def paged_case(gen, num_tokens, context_len, num_heads, num_kv_heads, head_size, dtype, block_size=16):
    """A request's rows at shuffled blocks of a cache with spare blocks: (query, key_cache, value_cache, block_ids),
    the caches token-major views [blocks, block_size, Hkv, D] of head-major storage, as the backend passes them."""
    total = context_len + num_tokens
    num_blocks = -(-total // block_size)
    cache = torch.randn(2, num_blocks + 5, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
    block_ids = (torch.randperm(num_blocks + 5, generator=gen)[:num_blocks]).long()
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    return query, cache[0].transpose(1, 2), cache[1].transpose(1, 2), block_ids


def reference(query, key_cache, value_cache, block_ids, context_len, scale, cap, window):
    """[n, Hq, Dv] in float64: token i (position context_len + i) over keys up to its position."""
    num_tokens, num_heads, _ = query.shape
    total = context_len + num_tokens
    keys = key_cache[block_ids].flatten(0, 1)[:total].double()  # [total, Hkv, D]
    values = value_cache[block_ids].flatten(0, 1)[:total].double()
    group = num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", query.double(), keys) * scale
    if cap:
        scores = cap * torch.tanh(scores / cap)
    position = torch.arange(context_len, total)[:, None]
    key = torch.arange(total)[None, :]
    visible = key <= position
    if window:
        visible &= key > position - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), values)


def run(module, query, key_cache, value_cache, block_ids, context_len, scale, cap=0.0, window=0, variant=-1):
    out = torch.empty(*query.shape[:2], value_cache.shape[-1], dtype=query.dtype)
    module.paged_prefill_attention(
        out, query, key_cache, value_cache, block_ids, context_len, scale, cap, window, variant=variant
    )
    return out


# (query tokens, cached context before them, query heads, KV heads, head size)
SHAPES = [
    (1, 0, 4, 2, 64),  # a single token
    (37, 0, 9, 3, 64),  # SmolLM2's heads, one chunk of keys
    (300, 0, 9, 3, 64),  # two chunks of 256 keys, tiles of 32 tokens
    (70, 500, 8, 2, 128),  # a chunk after a cached context of three chunks
    (33, 20, 4, 4, 80),  # MHA, 64 + 16 columns
    (19, 5, 6, 1, 96),  # MQA, 64 + 32 columns
    (5, 3, 2, 1, 48),  # 32 + 16 columns
    (20, 4500, 8, 8, 128),  # 18 chunks of keys: more than one window of packed chunks
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}q-{c}ctx-{h}x{kv}-d{d}" for n, c, h, kv, d in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_prefill_kernel_matches_softmax_attention(shape, dtype):
    from engine_attention_cpu import _C

    if not vector_build():
        pytest.skip("this build has no vector variant (no AVX2)")
    num_tokens, context_len, num_heads, num_kv_heads, head_size = shape
    gen = torch.Generator().manual_seed(num_tokens * 7 + context_len)
    case = paged_case(gen, num_tokens, context_len, num_heads, num_kv_heads, head_size, dtype)
    scale = 1 / math.sqrt(head_size)
    # float32 accumulation throughout; the bound is the output's own rounding in 16-bit dtypes
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for window, cap in [(0, 0.0), (24, 0.0), (0, 5.0), (300, 0.0)]:
        out = run(_C, *case, context_len, scale, cap, window)
        expected = reference(*case, context_len, scale, cap, window)
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance, msg=f"{window=} {cap=}")


def test_a_query_narrower_than_its_tensor_and_an_output_inside_a_larger_one():
    """The backend passes a chunk's rows of the step's q (a strided view) and writes into its rows of the step's
    output: the rows before and after stay untouched."""
    from engine_attention_cpu import _C

    if not vector_build():
        pytest.skip("this build has no vector variant (no AVX2)")
    gen = torch.Generator().manual_seed(3)
    query, key_cache, value_cache, block_ids = paged_case(gen, 40, 10, 6, 2, 64, torch.float32)
    step_q = torch.randn(60, 6, 64, generator=gen)
    step_q[12:52] = query
    output = torch.full((60, 6, 64), 7.0)
    _C.paged_prefill_attention(output[12:52], step_q[12:52], key_cache, value_cache, block_ids, 10, 0.125, 0.0, 0)
    expected = reference(query, key_cache, value_cache, block_ids, 10, 0.125, 0.0, 0)
    torch.testing.assert_close(output[12:52].double(), expected, atol=1e-5, rtol=1e-5)
    assert (output[:12] == 7.0).all() and (output[52:] == 7.0).all()


@pytest.mark.parametrize("window", [0, 100])
def test_a_tokens_output_is_the_same_bits_however_its_prompt_is_chunked_and_threaded(window):
    """Keys go in chunks of 256 counted from position 0 and the running softmax steps at their ends, whatever the
    query chunk, the tile or the thread count: a prompt attended whole, or in chunks after its cached part, on one
    thread or all, gives every token the same bits."""
    from engine_attention_cpu import _C

    if not vector_build():
        pytest.skip("this build has no vector variant (no AVX2)")
    gen = torch.Generator().manual_seed(5)
    query, key_cache, value_cache, block_ids = paged_case(gen, 600, 0, 9, 3, 64, torch.bfloat16)
    whole = run(_C, query, key_cache, value_cache, block_ids, 0, 0.125, window=window)
    pieces = torch.cat(
        [
            run(_C, query[start:end], key_cache, value_cache, block_ids, start, 0.125, window=window)
            for start, end in [(0, 37), (37, 300), (300, 301), (301, 600)]
        ]
    )
    assert torch.equal(pieces, whole)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = run(_C, query, key_cache, value_cache, block_ids, 0, 0.125, window=window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, whole)


def _prefill_modules():
    """(name, module, variant) for every ISA variant this machine can run: natively, and AVX-512 over SIMDe where
    the emulated build exists (CPUs without AVX-512)."""
    from engine_attention_cpu import _C

    found = [(f"native-{name}", _C, index) for index, (name, runs) in enumerate(_C.variants()) if runs]
    if importlib.util.find_spec("engine_attention_cpu._C_emulated") is not None:
        from engine_attention_cpu import _C_emulated

        found.append(("simde-avx512", _C_emulated, [n for n, _ in _C_emulated.variants()].index("avx512")))
    return found


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_every_isa_variant_gives_the_avx2_variants_bits(head_size, dtype):
    """The tiles are one source compiled per ISA (prefill_tiles.inc): AVX-512 takes 64 columns a tile where AVX2
    takes 16, with the same multiply-add chain per element, so the bits agree for every split of the head (64, 64 +
    16, 64 + 32, 64 + 32 + 16, 2 x 64, 32 + 16) and every mask. Where the CPU lacks AVX-512, its code runs over
    SIMDe."""
    from engine_attention_cpu import _C

    modules = _prefill_modules()
    if not any(name.endswith("avx512") for name, _, _ in modules):
        pytest.skip("neither AVX-512 nor the SIMDe build (cmeel-simde) is here")
    gen = torch.Generator().manual_seed(head_size)
    for num_tokens, context_len in [(45, 0), (29, 270)]:
        case = paged_case(gen, num_tokens, context_len, 6, 2, head_size, dtype)
        for window, cap in [(0, 0.0), (20, 0.0), (0, 5.0)]:
            expected = run(_C, *case, context_len, 0.125, cap, window, variant=0)
            for name, module, variant in modules:
                out = run(module, *case, context_len, 0.125, cap, window, variant=variant)
                assert torch.equal(out, expected), (name, num_tokens, context_len, window, cap)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16-cache", "fp16-cache"])
def test_a_16_bit_cache_under_float32_queries_reads_as_its_float32_widening(cache_dtype):
    """cache.kv_cache_dtype: the kernel packs a 16-bit cache's rows as float32, so a float32 chunk over it gives the
    float32 kernel's bits over the same rows widened, in every ISA variant."""
    from engine_attention_cpu import _C

    if not vector_build():
        pytest.skip("the prefill kernel needs a build with vector variants")
    gen = torch.Generator().manual_seed(3)
    for num_tokens, context_len in [(45, 0), (29, 270)]:
        query, key_cache, value_cache, block_ids = paged_case(gen, num_tokens, context_len, 9, 3, 64, torch.float32)
        narrow_keys, narrow_values = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
        for window, cap in [(0, 0.0), (20, 0.0), (0, 5.0)]:
            expected = run(
                _C, query, narrow_keys.float(), narrow_values.float(), block_ids, context_len, 0.125, cap, window
            )
            for name, module, variant in _prefill_modules():
                out = run(
                    module,
                    query,
                    narrow_keys,
                    narrow_values,
                    block_ids,
                    context_len,
                    0.125,
                    cap,
                    window,
                    variant=variant,
                )
                assert torch.equal(out, expected), (name, num_tokens, context_len, window, cap)


def test_bad_arguments_are_refused():
    from engine_attention_cpu import _C

    gen = torch.Generator().manual_seed(0)
    query, key_cache, value_cache, block_ids = paged_case(gen, 8, 20, 4, 2, 64, torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="cover the context and the chunk"):
        _C.paged_prefill_attention(out, query, key_cache, value_cache, block_ids[:1], 20, 0.1, 0.0, 0)
    with pytest.raises(RuntimeError, match="int64"):
        _C.paged_prefill_attention(out, query, key_cache, value_cache, block_ids.int(), 20, 0.1, 0.0, 0)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        _C.paged_prefill_attention(
            out[..., :40], query[..., :40], key_cache[..., :40], value_cache[..., :40], block_ids, 20, 0.1, 0.0, 0
        )
    lacking = [index for index, (_, runs) in enumerate(_C.variants()) if not runs]
    for variant in lacking + [7]:
        with pytest.raises(RuntimeError, match="lacks the instructions of attention variant"):
            _C.paged_prefill_attention(out, query, key_cache, value_cache, block_ids, 20, 0.1, 0.0, 0, variant=variant)


@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_batched_tokens": 64}, {"attention_options": '{"prefill": "sdpa"}'}],
    ids=["whole-prompts", "chunks-after-context", "sdpa-by-option"],
)
def test_long_prompts_through_the_kernel_decode_as_transformers_does(tiny_llama, hf_tiny_llama, monkeypatch, config):
    """Prompts of 130-300 tokens (whole, or in chunks of 64 after their cached part) attend through the kernel in
    the engine, and greedy decoding equals transformers'; ``attention.options`` {"prefill": "sdpa"} (as ``--ab``
    passes it, JSON text) sends them through SDPA instead, with the same tokens."""
    from engine import LLM, SamplingParams
    from engine_attention_cpu import _C

    if not vector_build():
        pytest.skip("this build has no vector variant (no AVX2)")
    calls = []
    kernel = _C.paged_prefill_attention

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(_C, "paged_prefill_attention", counted)
    prompts = random_prompts(4, (130, 300), seed=11)
    llm = LLM(tiny_llama, dtype="float32", attention="cpu", **config)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_tiny_llama, prompts, 16)
    if "attention_options" in config:
        assert not calls, "the sdpa option still went through the kernel"
    else:
        assert calls, "no prompt chunk went through the kernel"
    assert_all_blocks_free(llm)


def test_an_unknown_prefill_option_names_the_key_and_the_choices():
    from engine.config import ConfigError
    from engine_attention_cpu.attention import CpuAttentionImpl

    with pytest.raises(ConfigError, match=r"attention.options.prefill: 'fast' is not one of 'kernel', 'sdpa'"):
        CpuAttentionImpl(4, 64, 0.125, 2, None, None, {"prefill": "fast"})
