"""Batch invariance (``model.batch_invariant``): a request's sampled tokens and the logprobs returned for them are
the same bits whether it runs alone or in any batch, chunking, cache state or schedule.

Every comparison is bitwise (``==`` on floats). Each target request runs once alone, at the default budget, and is
then compared wherever it lands in the runs below; the control at the end shows that without the setting the same
comparison fails, so these tests can."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.testing.models import random_prompts
from tests.helpers import assert_all_blocks_free, oracle_spec_config

MAX_TOKENS = 20
# wide enough that a product's k runs over more than one chunk of the GEMM (576) and the head has 49152 columns
MODEL = dict(hidden_size=192, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2)
TARGETS = random_prompts(4, (30, 70), seed=11)
FILLERS = random_prompts(10, (3, 120), seed=12)


def target_params(index: int) -> SamplingParams:
    """Greedy for even targets, seeded sampling for odd ones; logprobs for both (the sampled token's and the top 5)."""
    if index % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + index, max_tokens=MAX_TOKENS, logprobs=5)


def filler_params(index: int) -> SamplingParams:
    return SamplingParams(temperature=0.7, seed=index, max_tokens=5 + 7 * (index % 4), ignore_eos=True)


def bits(output) -> tuple:
    """A completion's token ids and every returned logprob (token id -> value), compared with ``==``."""
    completion = output.outputs[0]
    return completion.token_ids, [{k: v.logprob for k, v in step.items()} for step in completion.logprobs]


def run(model: str, prompts: list[list[int]], params: list[SamplingParams], dtype: str, **config) -> tuple[list, LLM]:
    llm = LLM(model, dtype=dtype, batch_invariant=True, **config)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return outputs, llm


def mixed_batch(seed: int, num_fillers: int) -> tuple[list[list[int]], list[SamplingParams], dict[int, int]]:
    """The targets among ``num_fillers`` fillers in a shuffled order; target index -> its place in the batch."""
    entries = [("t", i) for i in range(len(TARGETS))] + [("f", i) for i in range(num_fillers)]
    random.Random(seed).shuffle(entries)
    prompts = [TARGETS[i] if kind == "t" else FILLERS[i] for kind, i in entries]
    params = [target_params(i) if kind == "t" else filler_params(i) for kind, i in entries]
    places = {i: place for place, (kind, i) in enumerate(entries) if kind == "t"}
    return prompts, params, places


@pytest.fixture(scope="module")
def model_dir(make_tiny_model) -> str:
    return make_tiny_model(**MODEL)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def alone(request, model_dir) -> tuple[str, list[tuple]]:
    """Each target run by itself (batch size 1, one generate call after the other), with the default token budget."""
    dtype = request.param
    llm = LLM(model_dir, dtype=dtype, batch_invariant=True)
    results = []
    for i, prompt in enumerate(TARGETS):
        (output,) = llm.generate([{"prompt_token_ids": prompt}], [target_params(i)], use_tqdm=False)
        results.append(bits(output))
    assert llm.get_stats().prefix_cache_hits == 0  # each ran cold, as alone as in an engine of its own
    llm.shutdown()
    return dtype, results


@pytest.fixture
def alone_float32(alone) -> list[tuple]:
    """The float32 references, for the cases that exercise the scheduler rather than the kernels' dtype."""
    if alone[0] != "float32":
        pytest.skip("the scheduler's paths are the same in bfloat16: float32 covers them")
    return alone[1]


def assert_targets_match(alone_bits: list[tuple], outputs, places: dict[int, int]) -> None:
    for index, place in places.items():
        tokens, logprobs = bits(outputs[place])
        assert tokens == alone_bits[index][0], f"target {index}: tokens differ from its run alone"
        assert logprobs == alone_bits[index][1], f"target {index}: logprobs differ from its run alone"


@pytest.mark.parametrize("batch_size", [2, 6, 14])
def test_logprobs_bitwise_batch_invariance_bs1_vs_bsN(model_dir, alone, batch_size):
    """vLLM's test: the same requests at batch size 1 and N, in every position of a shuffled batch."""
    dtype, alone_bits = alone
    prompts, params, places = mixed_batch(batch_size, batch_size - len(TARGETS) if batch_size > 4 else 0)
    if batch_size == 2:  # two targets only
        prompts, params = [TARGETS[1], TARGETS[0]], [target_params(1), target_params(0)]
        places = {1: 0, 0: 1}
    outputs, _ = run(model_dir, prompts, params, dtype)
    assert_targets_match(alone_bits, outputs, places)


@pytest.mark.parametrize("budget", [7, 32, 96])
def test_any_token_budget_splits_prompts_into_other_chunks_with_the_same_bits(model_dir, alone, budget):
    dtype, alone_bits = alone
    prompts, params, places = mixed_batch(2, 6)
    outputs, _ = run(model_dir, prompts, params, dtype, max_num_batched_tokens=budget)
    assert_targets_match(alone_bits, outputs, places)


def test_prefix_cache_hits_and_misses_give_the_same_bits(model_dir, alone_float32):
    dtype, alone_bits = "float32", alone_float32
    llm = LLM(model_dir, dtype=dtype, batch_invariant=True, block_size=8)
    # first a sibling sharing each target's first 24 tokens, so that the targets then hit its cached blocks
    siblings = [prompt[:24] + FILLERS[i][:5] for i, prompt in enumerate(TARGETS)]
    llm.generate([{"prompt_token_ids": p} for p in siblings], SamplingParams(max_tokens=2), use_tqdm=False)
    hits_before = llm.get_stats().prefix_cache_hits
    for _ in range(2):  # the second round hits the targets' own blocks
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in TARGETS], [target_params(i) for i in range(len(TARGETS))], use_tqdm=False
        )
        assert_targets_match(alone_bits, outputs, {i: i for i in range(len(TARGETS))})
    assert llm.get_stats().prefix_cache_hits >= hits_before + len(TARGETS) * 24
    assert_all_blocks_free(llm)


def test_preemption_and_recompute_give_the_same_bits(model_dir, alone_float32):
    dtype, alone_bits = "float32", alone_float32
    prompts, params, places = mixed_batch(3, 8)
    outputs, llm = run(model_dir, prompts, params, dtype, num_gpu_blocks_override=24, block_size=8, max_model_len=192)
    assert llm.get_stats().num_preemptions > 0
    assert_targets_match(alone_bits, outputs, places)


def test_async_scheduling_gives_the_same_bits(model_dir, alone_float32):
    dtype, alone_bits = "float32", alone_float32
    prompts, params, places = mixed_batch(4, 6)
    outputs, _ = run(model_dir, prompts, params, dtype, async_scheduling=True, max_num_batched_tokens=40)
    assert_targets_match(alone_bits, outputs, places)


def test_speculative_decoding_gives_the_tokens_of_plain_decoding(model_dir, alone, oracle):
    """Drafts accepted and rejected (the oracle proposer drafts the greedy continuation, one draft in three made
    wrong): greedy and seeded targets keep their tokens and logprobs; seeded rows use the coupled rule."""
    dtype, alone_bits = alone
    reference = {",".join(map(str, p)): alone_bits[i][0] for i, p in enumerate(TARGETS) if i % 2 == 0}
    for i in range(1, len(TARGETS), 2):  # a seeded target's drafts: its own samples, every third one wrong
        reference[",".join(map(str, TARGETS[i]))] = alone_bits[i][0]
    spec = oracle_spec_config(oracle, reference)
    prompts, params, places = mixed_batch(5, 4)
    outputs, llm = run(model_dir, prompts, params, dtype, speculative_config=spec)
    counters = llm.get_stats().spec_decoding
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert_targets_match(alone_bits, outputs, places)


def test_every_data_parallel_rank_gives_the_same_bits(model_dir, alone_float32):
    dtype, alone_bits = "float32", alone_float32
    prompts, params, places = mixed_batch(6, 6)
    llm = LLM(model_dir, dtype=dtype, batch_invariant=True, data_parallel_size=2)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_targets_match(alone_bits, outputs, places)
        received = [rank.num_requests_received for rank in llm.get_stats().per_rank]
        assert len(received) == 2 and min(received) > 0, received
    finally:
        llm.shutdown()


def test_the_quantized_default_model_is_batch_invariant(smollm2_gguf):
    """SmolLM2 kept packed in Q4_1: every product on one packed kernel, whatever the rows."""
    prompts = random_prompts(5, (10, 90), seed=21, vocab=(100, 20000))
    params = [target_params(i) for i in range(len(prompts))]
    alone_bits = bits(run(smollm2_gguf, prompts[1:2], params[1:2], "float32")[0][0])  # seeded, with logprobs
    outputs, _ = run(smollm2_gguf, prompts, params, "float32", max_num_batched_tokens=48)
    assert bits(outputs[1]) == alone_bits


def test_a_mixture_of_experts_model_is_batch_invariant(make_tiny_model):
    model = make_tiny_model("MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    params = [target_params(i) for i in range(len(TARGETS))]
    alone_bits = [bits(run(model, [p], [params[i]], "float32")[0][0]) for i, p in enumerate(TARGETS[:2])]
    outputs, _ = run(model, TARGETS + FILLERS[:6], params + [filler_params(i) for i in range(6)], "float32")
    assert_targets_match(alone_bits, outputs, {0: 0, 1: 1})


def test_without_the_setting_chunking_changes_the_bits(model_dir):
    """The control: the comparison above fails on the default kernels, where a prompt chunk attends through the
    prompt path and a decode token through the decode kernel."""

    def logprobs(**config) -> list:
        llm = LLM(model_dir, dtype="float32", **config)
        (output,) = llm.generate([{"prompt_token_ids": TARGETS[0]}], [target_params(0)], use_tqdm=False)
        return bits(output)[1]

    assert logprobs(max_num_batched_tokens=7) != logprobs()
    assert logprobs(max_num_batched_tokens=7, batch_invariant=True) == logprobs(batch_invariant=True)


@pytest.mark.parametrize(
    "setting, named",
    [({"layer_kernels": "native"}, "native"), ({"attention": "torch"}, "torch")],
)
def test_parts_that_cannot_run_batch_invariant_are_refused_by_name(model_dir, setting, named):
    with pytest.raises(ConfigError) as info:
        LLM(model_dir, dtype="float32", batch_invariant=True, **setting)
    message = str(info.value)
    assert named in message and "batch_invariant" in message, message
