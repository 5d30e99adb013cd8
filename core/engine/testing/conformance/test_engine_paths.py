"""Executors, KV-cache coordinators and model families end to end: the tiny model (or yours) gives
transformers' greedy tokens through them, and every KV block goes back to the pool, aborts included."""

from __future__ import annotations

import pytest

from engine.testing.conformance.conftest import implementation
from engine.testing.models import hf_greedy, random_prompts

PROMPTS = random_prompts(6, (5, 60), seed=3)
SHARED = random_prompts(1, (40, 40), seed=4)[0]
PREFIXED = [SHARED + tail for tail in random_prompts(3, (2, 12), seed=5)]


def generate_and_check(llm, hf_model, prompts, max_tokens=8):
    from engine import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, max_tokens)


def assert_all_blocks_free(llm):
    stats = llm.get_stats()
    assert (
        stats.num_free_blocks == stats.num_total_blocks and not stats.num_running_reqs and not stats.num_waiting_reqs
    ), stats


def abort_midway(llm):
    from engine import SamplingParams

    engine = llm.llm_engine
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()


def test_executor_runs_the_model_to_transformers_tokens(executor_name, tiny_model, hf_tiny_model, request):
    from engine import LLM

    world = request.config.getoption("engine_tensor_parallel_size")
    implementation("executor", executor_name, tensor_parallel_size=world)
    llm = LLM(tiny_model, dtype="float32", executor=executor_name, tensor_parallel_size=world, max_model_len=256)
    try:
        generate_and_check(llm, hf_tiny_model, PROMPTS)
        abort_midway(llm)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kv_blocks", [None, 12], ids=["roomy", "tight"])
def test_coordinator_returns_every_block(kv_cache_coordinator_name, kv_blocks, tiny_model, hf_tiny_model):
    from engine import LLM

    implementation("kv_cache_coordinator", kv_cache_coordinator_name)
    llm = LLM(
        tiny_model,
        dtype="float32",
        kv_cache_coordinator=kv_cache_coordinator_name,
        max_model_len=128,
        num_gpu_blocks_override=kv_blocks,
        max_num_batched_tokens=64,
    )
    try:
        generate_and_check(llm, hf_tiny_model, PREFIXED + PROMPTS[:3])  # shared prefixes, preemption when tight
        generate_and_check(llm, hf_tiny_model, PREFIXED)  # again: prefix hits where the coordinator serves them
        abort_midway(llm)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_model_family_matches_transformers(model_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine import LLM

    if model_path is None:
        pytest.skip("no model named (--engine-model PATH: a small Hugging Face folder of your architecture)")
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = random_prompts(4, (5, 40), seed=6, vocab=(10, min(vocab, 40000)))
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").eval()
    llm = LLM(model_path, dtype="float32", max_model_len=256)
    try:
        generate_and_check(llm, hf_model, prompts)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
