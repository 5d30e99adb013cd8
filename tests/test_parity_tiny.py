"""Greedy parity with transformers on tiny random Llama models, across every KV-cache path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.helpers import assert_all_blocks_free, hf_greedy, random_prompts

MAX_TOKENS = 24
PROMPTS = random_prompts(6, (5, 70), seed=1)


def engine_tokens(model_dir: str, prompts, max_tokens: int = MAX_TOKENS, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, dtype="float32", **config)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
    )
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def reference(hf_tiny_llama):
    return hf_greedy(hf_tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill of every prompt
        {"num_gpu_blocks_override": 12, "block_size": 8, "max_model_len": 96},  # forces preemption
        {"enable_prefix_caching": False},
        {"max_num_seqs": 2},
        {"attention": "torch", "max_num_batched_tokens": 16},  # the reference backend (auto picks cpu when built)
    ],
    ids=["default", "chunked", "preempt", "no-prefix", "two-seqs", "torch-backend"],
)
def test_greedy_matches_transformers(tiny_llama, reference, config):
    tokens, llm = engine_tokens(tiny_llama, PROMPTS, **config)
    assert tokens == reference
    if "num_gpu_blocks_override" in config:
        assert llm.get_stats().num_preemptions > 0


def test_prefix_cache_hits_give_same_tokens(tiny_llama, hf_tiny_llama):
    shared = random_prompts(1, (64, 64), seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(4, (3, 20), seed=8)] + random_prompts(4, (10, 40), seed=9)
    reference = hf_greedy(hf_tiny_llama, prompts, 16)
    llm = LLM(tiny_llama, dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=16)
    first = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    stats = llm.get_stats()
    assert stats.prefix_cache_hits >= 3 * 64, stats  # the three followers reuse the shared 64 tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert first == reference
    assert [o.outputs[0].token_ids for o in again] == reference
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False},
        {"attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 1, "head_dim": 32},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ],
    ids=["untied", "bias", "mqa-headdim", "llama3-rope", "linear-rope"],
)
def test_llama_variants_match_transformers(make_tiny_model, overrides):
    model_dir = make_tiny_model(**overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = PROMPTS[:3] + [random_prompts(1, (150, 150), seed=3)[0]]  # one past llama3's original context
    tokens, _ = engine_tokens(model_dir, prompts, max_tokens=12)
    assert tokens == hf_greedy(hf, prompts, 12)


def test_sharded_checkpoint_loads_the_same(make_tiny_model, tiny_llama, reference):
    sharded = make_tiny_model(max_shard_size="300KB")
    import os

    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    tokens, _ = engine_tokens(sharded, PROMPTS)
    assert tokens == reference


def test_bfloat16_runs_close_to_float32(tiny_llama, reference):
    llm = LLM(tiny_llama, dtype="bfloat16")
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    first_tokens = [o.outputs[0].token_ids[0] for o in outputs]
    agree = sum(a == r[0] for a, r in zip(first_tokens, reference))
    assert agree >= len(PROMPTS) - 1, (first_tokens, [r[0] for r in reference])
