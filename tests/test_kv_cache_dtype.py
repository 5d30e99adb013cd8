"""``cache.kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``): a float32 model keeps its K/V in bfloat16 or float16.

The cache holds twice the tokens in the same memory, a decode step reads half the bytes of its context, and
attention still computes in float32 over the rows as the cache holds them. Held to transformers' greedy tokens
(top-5 where a near-tie parts them, the parity rule's fallback) on every path that reads the cache: the ``cpu``
kernels, the ``torch`` reference, chunked prompts, prefix-cache hits and preemption; settings that cannot keep a
narrower cache are refused with the key and the reason.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import ConfigError
from engine.testing import inspect
from tests.helpers import assert_all_blocks_free, assert_greedy_or_top5, hf_greedy, random_prompts

MAX_TOKENS = 20
PROMPTS = random_prompts(6, (5, 70), seed=11)


@pytest.fixture(scope="module")
def reference(hf_tiny_llama):
    return hf_greedy(hf_tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prompts: later chunks read earlier ones from the cache
        {"num_gpu_blocks_override": 12, "block_size": 8, "max_model_len": 96},  # preemption, recomputed prompts
        {"attention": "torch"},
        {"attention": "torch", "max_num_batched_tokens": 16},
        {"attention.options": {"prefill": "sdpa"}},  # the cpu backend's prompts through SDPA
    ],
    ids=["cpu", "cpu-chunked", "cpu-preempt", "torch", "torch-chunked", "cpu-sdpa-prompts"],
)
def test_a_16_bit_cache_under_a_float32_model_decodes_as_transformers(tiny_llama, reference, kv_cache_dtype, config):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype=kv_cache_dtype, **config)
    runner = inspect(llm).model_runner
    layer = next(iter(runner.attention_layers.values()))
    assert layer.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    assert_greedy_or_top5(llm, PROMPTS, reference, MAX_TOKENS, kv_cache_dtype)
    assert_all_blocks_free(llm)
    if "num_gpu_blocks_override" in config:
        assert llm.get_stats().num_preemptions > 0
    llm.shutdown()


def test_prefix_cache_hits_read_the_same_16_bit_rows_as_the_cold_run(tiny_llama):
    """A prompt that reuses cached blocks attends to the rows its first run rounded into them: under
    model.batch_invariant (every token through one kernel, whatever the chunking) its tokens and logprobs are the
    cold run's bits."""
    from engine import SamplingParams

    shared = random_prompts(1, (48, 48), seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(3, (4, 12), seed=4)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype="float16", block_size=16, batch_invariant=True)
    cold = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params, use_tqdm=False)
    warm = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert warm[0].num_cached_tokens >= 48
    assert warm[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
    assert warm[0].outputs[0].logprobs == cold[0].outputs[0].logprobs
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_the_same_memory_holds_twice_the_blocks(tiny_llama):
    blocks = {}
    for kv_cache_dtype in ("auto", "bfloat16"):
        llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="8MiB")
        spec = next(iter(inspect(llm).model_runner.get_kv_cache_spec().values()))
        blocks[kv_cache_dtype] = (llm.get_stats().num_total_blocks, spec.page_size_bytes)
        llm.shutdown()
    assert blocks["bfloat16"][1] * 2 == blocks["auto"][1]
    assert blocks["bfloat16"][0] == 2 * blocks["auto"][0]


def test_settings_that_cannot_keep_a_narrower_cache_are_refused_with_the_key(tiny_llama, make_tiny_model):
    # a 16-bit cache under a 16-bit model of the other kind: the kernels read a float32 model's queries only
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=float16 under a bfloat16 model"):
        LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="float16")
    # a float32 cache under a 16-bit model would only widen what the model computes
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=float32 under a bfloat16 model unsupported: a wider cache"):
        LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="float32")
    # an unknown dtype names the key and the choices
    with pytest.raises(ConfigError, match=r"kv_cache_dtype(.|\n)*'auto', 'float32', 'bfloat16' or 'float16'"):
        LLM(tiny_llama, kv_cache_dtype="fp8")
    # MLA's latent cache keeps the model's dtype
    from tests.test_mla import FAMILIES

    config_cls, overrides = FAMILIES["deepseek-v2"]
    with pytest.raises(ConfigError, match="MLA latent cache keeps the model's dtype"):
        LLM(make_tiny_model(config_cls, **overrides), dtype="float32", kv_cache_dtype="bfloat16")


def test_auto_and_the_models_own_dtype_are_the_same_cache(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="bfloat16", kv_cache_memory="8MiB")
    layer = next(iter(inspect(llm).model_runner.attention_layers.values()))
    assert layer.kv_cache.dtype == torch.bfloat16
    llm.shutdown()


def test_a_hybrid_models_attention_layers_keep_a_16_bit_cache_beside_the_mamba_states(make_tiny_model):
    """Bamba: the attention pages shrink by half while the Mamba states keep their dtype; the shared pages still fit
    both (the block size is raised where a state outgrows a page) and the tokens are transformers'."""
    from tests.test_mamba import PROMPTS as HYBRID_PROMPTS
    from tests.test_mamba import family_model

    model_dir, hf_model, reference = family_model(make_tiny_model, "bamba")
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype="float16")
    runner = inspect(llm).model_runner
    assert next(iter(runner.attention_layers.values())).kv_cache.dtype == torch.float16
    max_tokens = len(reference[0])
    assert_greedy_or_top5(llm, HYBRID_PROMPTS, reference, max_tokens, "bamba")
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_a_draft_models_cache_takes_the_same_dtype_and_the_tokens_stay_the_plain_runs(tiny_llama):
    from engine import SamplingParams

    prompts = random_prompts(3, (5, 40), seed=12, vocab=(100, 1000))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for spec in (None, {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": tiny_llama}):
        extra = {"speculative_config": spec, "max_num_batched_tokens": 24} if spec else {}
        llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype="float16", **extra)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[spec is None] = [o.outputs[0].token_ids for o in outputs]
        if spec:
            proposer = inspect(llm).model_runner.proposer
            draft_layer = next(m for m in proposer.model.modules() if hasattr(m, "kv_cache") and m.kv_cache is not None)
            assert draft_layer.kv_cache.dtype == torch.float16
            assert llm.get_stats().spec_decoding.acceptance_rate > 0.9
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert runs[False] == runs[True]
