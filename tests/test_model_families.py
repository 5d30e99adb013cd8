"""Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3: greedy parity with transformers on tiny random models,
over prompts longer than the sliding window, and the hybrid KV-cache coordinator's block accounting."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.testing import inspect
from tests.helpers import assert_all_blocks_free, engine_greedy, hf_greedy, random_prompts

WINDOW = 12  # not a multiple of any block size used below
MAX_TOKENS = 20
PROMPTS = random_prompts(5, (6, 60), seed=11)  # most run past the window, some by several blocks

FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen2-sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            num_hidden_layers=3,
            rope_theta=100000.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, make_tiny_model):
    config_cls, overrides = FAMILIES[request.param]
    model_dir = make_tiny_model(config_cls, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, hf_model, hf_greedy(hf_model, PROMPTS, MAX_TOKENS)


def kv_cache_manager(llm: LLM):
    return inspect(llm).kv_cache_manager


@pytest.mark.parametrize(
    "config",
    [
        {"block_size": 8},
        {"block_size": 8, "enable_prefix_caching": False},
        {"block_size": 8, "max_num_batched_tokens": 10},  # chunked prefill: chunks smaller than the window
        {"block_size": 16, "max_num_batched_tokens": 24, "max_num_seqs": 2},
    ],
    ids=["prefix-cache", "no-prefix", "chunked", "block16-chunked"],
)
def test_family_greedy_matches_transformers(family, config):
    name, model_dir, _, reference = family
    tokens, _ = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, **config)
    assert tokens == reference, name


def test_gemma3_with_triton_kernels_matches_transformers(make_tiny_model):
    """The triton backend (interpreted on the CPU) over the hybrid cache: null blocks, windows, prefixes."""
    pytest.importorskip("triton")
    config_cls, overrides = FAMILIES["gemma3"]
    model_dir = make_tiny_model(config_cls, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [PROMPTS[0], PROMPTS[2]]
    tokens, _ = engine_greedy(model_dir, prompts, 8, attention="triton", block_size=8, max_num_batched_tokens=16)
    assert tokens == hf_greedy(hf_model, prompts, 8)


def test_families_resolve_to_their_classes(family):
    name, model_dir, _, _ = family
    from engine.config import ModelConfig
    from engine.model.loader import get_model_class
    from engine.model.model_info import resolve_model

    info = resolve_model(ModelConfig(model=model_dir))
    cls = get_model_class(info.architecture)
    expected = {
        "mistral": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen2-sliding": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
    }
    assert cls.__name__ == expected[name]


@pytest.mark.parametrize("family_name", ["gemma2", "gemma3"])
def test_hybrid_prefix_hits_equal_cold_run(make_tiny_model, family_name):
    config_cls, overrides = FAMILIES[family_name]
    model_dir = make_tiny_model(config_cls, **overrides)
    shared = random_prompts(1, (40, 40), seed=21)[0]
    prompts = [shared + tail for tail in random_prompts(4, (2, 9), seed=22)]
    cold, _ = engine_greedy(model_dir, prompts, 12, block_size=8, enable_prefix_caching=False)
    llm = LLM(model_dir, dtype="float32", block_size=8)
    assert inspect(llm).plugins["kv_cache_coordinator"].name == "hybrid"
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == cold
    assert [o.outputs[0].token_ids for o in again] == cold
    # every follower (and the whole second round) reuses the 40 shared tokens = 5 blocks in every group
    assert all(o.num_cached_tokens >= 40 for o in first[1:]) and all(o.num_cached_tokens >= 40 for o in again)
    assert_all_blocks_free(llm)


def test_gemma3_sliding_group_stays_within_window_while_full_group_grows(make_tiny_model):
    config_cls, overrides = FAMILIES["gemma3"]
    model_dir = make_tiny_model(config_cls, **overrides)
    block_size, prompt_len, max_tokens = 8, 10, 150
    tokens, llm = engine_greedy(model_dir, [list(range(300, 300 + prompt_len))], max_tokens, block_size=block_size)
    assert len(tokens[0]) == max_tokens
    manager = kv_cache_manager(llm)
    groups = manager.kv_cache_config.groups
    kinds = [type(group.spec).__name__ for group in groups]
    assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec", "SlidingWindowSpec"], kinds
    usage = manager.group_block_usage()
    total_len = prompt_len + max_tokens
    for kind, (held_now, peak) in zip(kinds, usage):
        assert held_now == 0  # everything went back
        if kind == "SlidingWindowSpec":
            # the window plus the block being written and the one a decode step may open
            assert peak <= -(-(WINDOW - 1) // block_size) + 2, usage
        else:
            assert peak == -(-(total_len - 1) // block_size), usage  # the last sampled token needs no slot


def test_hybrid_layout_shares_cache_tensors(make_tiny_model):
    """Gemma 3's 2 sliding : 1 full layers make 3 groups of one layer over one shared tensor per block id."""
    from engine.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config

    full = FullAttentionSpec(16, 2, 16, torch.float32)
    window = SlidingWindowSpec(16, 2, 16, torch.float32, sliding_window=WINDOW)
    specs = {"l0": window, "l1": window, "l2": full, "l3": window, "l4": window, "l5": full}
    config = make_kv_cache_config(specs, 100 * 2 * full.page_size_bytes, None, 64)
    assert config.num_blocks == 100  # a block id costs one page in each of the two shared tensors
    assert [group.layer_names for group in config.groups] == [("l0", "l1"), ("l3", "l4"), ("l2", "l5")]
    assert config.tensors == (("l0", "l3", "l2"), ("l1", "l4", "l5"))


def test_coordinator_choice_and_errors(make_tiny_model):
    from engine.config import VllmConfig
    from engine.engine_core.engine_core import select_plugins
    from engine.model.model_info import resolve_model

    config_cls, overrides = FAMILIES["gemma3"]
    model_dir = make_tiny_model(config_cls, **overrides)

    def chosen(**kwargs):
        config = VllmConfig.load(model=model_dir, **kwargs)
        return select_plugins(config, resolve_model(config.model))["kv_cache_coordinator"].name

    assert chosen() == "hybrid"
    assert chosen(enable_prefix_caching=False) == "no_prefix"
    with pytest.raises(ConfigError, match=r"cache.kv_cache_coordinator.*unitary.*KV-cache groups.*hybrid"):
        chosen(kv_cache_coordinator="unitary")
    with pytest.raises(ConfigError, match=r"unknown kv_cache_coordinator 'bogus'.*hybrid"):
        chosen(kv_cache_coordinator="bogus")
    config = VllmConfig.load(model=make_tiny_model())
    assert select_plugins(config, resolve_model(config.model))["kv_cache_coordinator"].name == "unitary"


def test_load_weights_must_return_the_loaded_names(tiny_llama, monkeypatch):
    """A family whose load_weights returns None gets an error naming it, not a TypeError from set arithmetic."""
    from engine.config import ModelConfig
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import load_model
    from engine.model.model_info import resolve_model

    original = LlamaForCausalLM.load_weights
    monkeypatch.setattr(LlamaForCausalLM, "load_weights", lambda self, weights: (original(self, weights), None)[1])
    with pytest.raises(
        TypeError,
        match=r"engine\.model\.llama\.LlamaForCausalLM\.load_weights must return the set "
        r"of parameter names it loaded, got NoneType",
    ):
        load_model(
            resolve_model(ModelConfig(model=tiny_llama, dtype="float32")), torch.device("cpu"), show_progress=False
        )
