"""Pipeline parallelism (parallel.pipeline_parallel_size) with the multiproc executor: each stage holds a slice
of the layers and only their KV caches, stages hand the residual stream on with send/recv, the engine core keeps
one step per stage in flight, and TP x PP compose; greedy tokens equal transformers' under chunked prefill and
preemption."""

from __future__ import annotations

import re
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import ConfigError, VllmConfig
from engine.distributed.parallel_state import pipeline_layer_range
from engine.testing import inspect
from tests.helpers import assert_all_blocks_free, hf_greedy, random_prompts

PROMPTS = random_prompts(6, (5, 60), seed=23)
MAX_TOKENS = 16
# small steps and a small KV pool: prompts are cut into chunks and requests get preempted
STRESS = dict(max_num_batched_tokens=24, block_size=8, num_gpu_blocks_override=24, max_model_len=128, num_threads=1)


def executor_of(llm: LLM):
    return inspect(llm).executor


def run_counting_steps_in_flight(llm: LLM, prompts, max_tokens: int = MAX_TOKENS):
    """Greedy tokens, and the most steps that were in flight at once."""
    executor = executor_of(llm)
    submit = executor.execute_model
    pending: list[Future] = []
    most = [0]

    def counting(scheduler_output, non_block: bool = False):
        result = submit(scheduler_output, non_block)
        if non_block:
            pending[:] = [f for f in pending if not f.done()] + [result]
            most[0] = max(most[0], len(pending))
        return result

    executor.execute_model = counting
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens),
            use_tqdm=False,
        )
    finally:
        executor.execute_model = submit
    return [o.outputs[0].token_ids for o in outputs], most[0]


@pytest.fixture(scope="module")
def tiny_llama_5_layers(make_tiny_model):
    """Five layers (3 + 2 over two stages), an untied LM head."""
    return make_tiny_model(num_hidden_layers=5, tie_word_embeddings=False)


def test_layers_are_cut_into_contiguous_stages_the_first_taking_the_remainder():
    assert [pipeline_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pipeline_layer_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [pipeline_layer_range(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(pipeline_parallel_size=2, async_scheduling=True),
            "parallel.pipeline_parallel_size=2 and scheduler.async_scheduling cannot be combined",
        ),
        (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram"}), "speculative.method='ngram'"),
    ],
)
def test_combinations_pipeline_parallelism_cannot_run_are_refused_by_the_config(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        VllmConfig.load(**overrides)


def test_more_stages_than_layers_is_a_config_error_naming_the_key(tiny_llama):
    with pytest.raises(ConfigError, match=r"parallel.pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM(tiny_llama, dtype="float32", pipeline_parallel_size=3)


@pytest.fixture(scope="module")
def pp2_llm(tiny_llama_5_layers):
    llm = LLM(tiny_llama_5_layers, dtype="float32", pipeline_parallel_size=2, **STRESS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_5_layers(tiny_llama_5_layers):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_5_layers, dtype=torch.float32).eval()


def test_pp2_equals_transformers_with_chunked_prefill_preemption_and_stages_in_flight(pp2_llm, hf_5_layers):
    llm = pp2_llm
    executor = executor_of(llm)
    assert type(executor).__name__ == "MultiprocExecutor" and len(executor.workers) == 2
    # each stage holds its layers' KV caches only: 3 + 2 of the 5
    specs = executor.collective_rpc("get_kv_cache_spec")
    assert [sorted(int(re.search(r"layers\.(\d+)\.", name).group(1)) for name in stage) for stage in specs] == [
        [0, 1, 2],
        [3, 4],
    ]
    tokens, most_in_flight = run_counting_steps_in_flight(llm, PROMPTS)
    assert tokens == hf_greedy(hf_5_layers, PROMPTS, MAX_TOKENS)
    assert most_in_flight == 2  # the batch queue kept both stages busy
    stats = llm.get_stats()
    assert stats.num_preemptions > 0  # the small pool preempted (and the recomputed tokens still match)
    assert_all_blocks_free(llm)


def test_pp2_aborts_with_steps_in_flight_free_every_block_and_spare_the_others(pp2_llm, hf_5_layers):
    engine = pp2_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in PROMPTS[:4]]
    for _ in range(6):  # prefill chunks and first tokens in flight on both stages
        engine.step()
    engine.abort_request(ids[1:3])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    expected = hf_greedy(hf_5_layers, [PROMPTS[0], PROMPTS[3]], MAX_TOKENS)
    assert [finished[ids[0]], finished[ids[3]]] == expected
    assert_all_blocks_free(pp2_llm)


def test_tp2_x_pp2_four_workers_equal_transformers(tiny_llama, hf_tiny_llama):
    """Tied embeddings: the last stage holds its own copy of the embedding table for the LM head."""
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2, **STRESS)
    try:
        assert len(executor_of(llm).workers) == 4
        tokens, _ = run_counting_steps_in_flight(llm, PROMPTS)
        assert tokens == hf_greedy(hf_tiny_llama, PROMPTS, MAX_TOKENS)
        assert llm.get_stats().num_preemptions > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_gemma2_stages_hand_on_hidden_states_only_and_equal_transformers(make_tiny_model):
    """Gemma's sandwich norms keep no separate residual: its stages send one tensor, and sliding-window and
    full-attention layers (two KV-cache groups) are spread over the stages."""
    model_dir = make_tiny_model(
        "Gemma2Config",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=12,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        num_hidden_layers=4,
    )
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32", pipeline_parallel_size=2, **{**STRESS, "num_gpu_blocks_override": 48})
    try:
        tokens, _ = run_counting_steps_in_flight(llm, PROMPTS[:4])
        assert tokens == hf_greedy(hf_model, PROMPTS[:4], MAX_TOKENS)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
