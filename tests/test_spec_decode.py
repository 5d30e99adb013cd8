"""Speculative decoding: proposers as plugins, verification in the model runner.

The sceptic's questions, each a test:
- does the rejection sampler keep the target distribution, whatever the drafts' distribution (chi-square)?
- are greedy outputs the same tokens as without speculation, for every proposer, with long accepted runs and
  rejections at every position (the ``oracle`` fixture proposer drafts the reference, wrong now and then), with
  chunked prefill, preemption, prefix hits, logits processors, stop conditions, TP=2?
- do seeded sampled requests give the same tokens whatever shares their batch?
- does every KV block come back (rejected-token rollbacks, aborts)?
- are the combinations that cannot work refused at start-up?
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from engine.config import ConfigError, VllmConfig
from engine.spec_decode.dynamic import SpeculationPolicy
from engine.spec_decode.ngram import find_ngram_continuation
from engine.spec_decode.rejection_sampler import rejection_sample
from engine.spec_decode.suffix_tree import SuffixTrie, draft_from
from engine.testing import inspect
from engine.testing.models import random_prompts
from tests.helpers import assert_all_blocks_free, oracle_spec_config

COMMON = dict(kv_cache_memory="64MiB", layer_kernels="native", attention="torch")


# ---- the rejection sampler --------------------------------------------------------------------------------------
def _draft_distributions(p0: torch.Tensor, vocab: int) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(3)
    dense = torch.rand(vocab, generator=generator) ** 3
    missing = p0.clone()
    missing[p0.argmax()] = 0  # q puts nothing where p has the most
    return {
        "point mass (ngram, suffix)": None,
        "dense random": dense / dense.sum(),
        "equal to p": p0.clone(),
        "zero where p peaks": missing / missing.sum(),
        "uniform": torch.full((vocab,), 1.0 / vocab),
    }


@pytest.mark.parametrize(
    "draft", ["point mass (ngram, suffix)", "dense random", "equal to p", "zero where p peaks", "uniform"]
)
def test_rejection_sampling_keeps_the_target_distribution(draft):
    vocab, rows = 6, 60000
    p = torch.tensor(
        [
            [0.40, 0.25, 0.15, 0.10, 0.07, 0.03],
            [0.05, 0.05, 0.50, 0.10, 0.20, 0.10],
            [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
        ],
        dtype=torch.float64,
    )
    q0 = _draft_distributions(p[0], vocab)[draft]
    q = None if q0 is None else torch.stack([q0, q0.roll(1)])
    generator = torch.Generator().manual_seed(11)
    if q is None:  # deterministic drafts: a fixed guess at each position
        drafts = torch.tensor([[1, 2]]).expand(rows, 2).clone()
    else:
        drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=generator) for j in (0, 1)], 1)
    bonus = torch.multinomial(p[2], rows, replacement=True, generator=generator)
    target = torch.stack([torch.zeros(rows, dtype=torch.int64)] * 2 + [bonus], 1)  # argmax unused: no greedy row
    emitted = rejection_sample(
        drafts,
        torch.full((rows,), 2),
        target,
        torch.zeros(rows, dtype=torch.bool),
        p.unsqueeze(0).expand(rows, 3, vocab),
        None if q is None else q.unsqueeze(0).expand(rows, 2, vocab),
        torch.rand(rows, 2, 2, dtype=torch.float64, generator=generator),
    )
    first = np.array([tokens[0] for tokens in emitted])
    # the second token, among the rows whose first draft was accepted, must follow p at position 1
    second = np.array(
        [tokens[1] for tokens, d in zip(emitted, drafts[:, 0].tolist()) if len(tokens) > 1 and tokens[0] == d]
    )
    third = np.array([tokens[2] for tokens in emitted if len(tokens) == 3])
    for observed, expected in ((first, p[0]), (second, p[1]), (third, p[2])):
        assert len(observed) > 500
        counts = np.bincount(observed, minlength=vocab)
        assert chisquare(counts, expected.numpy() * len(observed)).pvalue > 1e-3, (draft, counts, expected)


def test_greedy_rows_keep_drafts_while_they_equal_the_argmax():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 0, 0]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [9, 9, 9, 9], [4, 3, 3, 3]])
    emitted = rejection_sample(drafts, torch.tensor([3, 3, 3, 1]), target, torch.ones(4, dtype=torch.bool))
    assert emitted == [[5, 6, 7, 8], [5, 6], [9], [4, 3]]


# ---- proposers, unit by unit --------------------------------------------------------------------------------------
def test_ngram_drafts_what_followed_the_latest_earlier_occurrence():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3])
    assert find_ngram_continuation(tokens, 2, 3, 3) == [4, 5, 7]  # latest earlier "1 2 3" is followed by 4 5 7
    assert find_ngram_continuation(tokens, 4, 5, 3) == []  # no earlier 4-gram "3 1 2 3"... "7 1 2 3"
    assert find_ngram_continuation(np.array([8, 8, 8]), 1, 2, 4) == [8]  # what exists after the match
    assert find_ngram_continuation(tokens, 2, 3, 0) == []


def test_suffix_trie_counts_forgets_and_drafts_the_frequent_continuation():
    trie = SuffixTrie(max_depth=4)
    trie.add_sequence([1, 2, 3, 1, 2, 4, 1, 2, 3])
    node = trie.match([7, 1, 2], 3)[-1]
    assert node.depth == 2 and node.count == 3 and node.child_total == 3
    assert draft_from(node, 3, 0.1) == ([3, 1], pytest.approx(2 / 3 + 2 / 3))
    assert draft_from(node, 3, 0.7) == ([], 0.0)  # "3" follows "1 2" only 2 times in 3
    trie.add_sequence([1, 2, 3, 1, 2, 4, 1, 2, 3], delta=-1)
    assert trie.root.children == {} and trie.root.child_total == 0


# ---- whole engines --------------------------------------------------------------------------------------------------
def _run(model, prompts, params, **settings):
    llm = LLM(model=model, **COMMON, **settings)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.get_stats()
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    return outputs, stats


def _greedy_params(count, max_tokens=40, **extra):
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens - 5 * (i % 4), ignore_eos=True, logprobs=3, **extra)
        for i in range(count)
    ]


def _assert_same(outputs, reference):
    for spec, plain in zip(outputs, reference):
        assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
        assert spec.outputs[0].finish_reason == plain.outputs[0].finish_reason
        for token, a, b in zip(spec.outputs[0].token_ids, spec.outputs[0].logprobs, plain.outputs[0].logprobs):
            assert a[token].rank == b[token].rank and abs(a[token].logprob - b[token].logprob) < 1e-3


SETTINGS = {
    "default": {},
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=12, max_model_len=128, max_num_batched_tokens=32),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "k=1": dict(k=1),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_equal_plain_decoding_with_drafts_accepted_and_rejected(tiny_llama, oracle, setting):
    settings = dict(SETTINGS[setting])
    k = settings.pop("k", 4)
    prompts = random_prompts(6, (5, 40), seed=5, vocab=(100, 1000))
    params = _greedy_params(len(prompts))
    reference, _ = _run(tiny_llama, prompts, params, **settings)
    spec = oracle_spec_config(
        oracle, {",".join(map(str, p)): o.outputs[0].token_ids for p, o in zip(prompts, reference)}, k
    )
    outputs, stats = _run(tiny_llama, prompts, params, speculative_config=spec, **settings)
    _assert_same(outputs, reference)
    counters = stats.spec_decoding
    # every position accepted and rejected somewhere; long runs accepted
    assert counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.mean_acceptance_length > 1 + 0.5 * k
    assert len(counters.num_accepted_tokens_per_pos) == k and min(counters.num_accepted_tokens_per_pos) > 0
    if setting == "preemption":
        assert stats.num_preemptions > 0


def test_prefix_hits_stop_conditions_and_logits_processors_stay_exact(tiny_llama, oracle):
    shared = random_prompts(1, (40, 40), seed=8, vocab=(100, 1000))[0]
    prompts = [shared + tail for tail in random_prompts(4, (3, 9), seed=9, vocab=(100, 1000))]
    plain = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    reference, _ = _run(tiny_llama, prompts, plain * 4)
    stop_token = reference[1].outputs[0].token_ids[12]
    stops_at = reference[1].outputs[0].token_ids.index(stop_token) + 1
    params = [
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, repetition_penalty=1.4, frequency_penalty=0.3
        ),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, stop_token_ids=[stop_token]),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            logprobs=2,
            bad_words_token_ids=[[reference[2].outputs[0].token_ids[5]]],
            min_tokens=3,
        ),
        SamplingParams(
            temperature=0,
            max_tokens=7,
            ignore_eos=True,
            logprobs=2,
            logit_bias={reference[3].outputs[0].token_ids[2]: -50.0},
        ),
    ]
    expected, _ = _run(tiny_llama, prompts, params)
    assert expected[1].outputs[0].finish_reason == "stop" and len(expected[1].outputs[0].token_ids) == stops_at
    spec = oracle_spec_config(
        oracle, {",".join(map(str, p)): o.outputs[0].token_ids for p, o in zip(prompts, reference)}, corrupt_every=4
    )
    outputs, stats = _run(tiny_llama, prompts, params, speculative_config=spec)
    _assert_same(outputs, expected)
    assert stats.prefix_cache_hits > 0 and stats.spec_decoding.num_accepted_tokens > 0


def test_seeded_sampling_with_drafts_does_not_depend_on_the_batch(tiny_llama, oracle):
    prompts = random_prompts(5, (5, 30), seed=3, vocab=(100, 1000))
    greedy, _ = _run(tiny_llama, prompts, _greedy_params(5))
    spec = oracle_spec_config(oracle, {",".join(map(str, p)): o.outputs[0].token_ids for p, o in zip(prompts, greedy)})
    # a low temperature keeps the samples close to the reference, so drafts get accepted as well as rejected
    seeded = [SamplingParams(temperature=0.05, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(5)]
    together, stats = _run(tiny_llama, prompts, seeded, speculative_config=spec)
    alone, _ = _run(tiny_llama, prompts[2:3], seeded[2:3], speculative_config=spec)
    assert alone[0].outputs[0].token_ids == together[2].outputs[0].token_ids
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_builtin_proposers_give_the_plain_greedy_tokens(make_tiny_model, method):
    # a 300-token vocabulary, so that a random model's outputs repeat and the proposers find matches
    tiny_llama = make_tiny_model(vocab_size=300)
    prompts = [p * 3 for p in random_prompts(4, (4, 12), seed=2, vocab=(5, 300))]
    params = _greedy_params(4, max_tokens=48)
    reference, _ = _run(tiny_llama, prompts, params)
    # exactness, not the policy: dynamic speculation would leave most of a random model's poor drafts out
    spec = {
        "method": method,
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
        "dynamic_speculation": False,
    }
    outputs, stats = _run(tiny_llama, prompts, params, speculative_config=spec, max_num_batched_tokens=24)
    _assert_same(outputs, reference)
    assert stats.spec_decoding.num_drafts > 0 and stats.spec_decoding.num_accepted_tokens > 0


def test_aborted_requests_with_drafts_in_flight_return_their_blocks(tiny_llama, oracle):
    prompts = random_prompts(3, (5, 20), seed=4, vocab=(100, 1000))
    reference, _ = _run(tiny_llama, prompts, _greedy_params(3, max_tokens=60))
    spec = oracle_spec_config(
        oracle, {",".join(map(str, p)): o.outputs[0].token_ids for p, o in zip(prompts, reference)}
    )
    llm = LLM(model=tiny_llama, speculative_config=spec, **COMMON)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), f"r{i}"
        )
    scheduler = inspect(engine).scheduler
    for _ in range(20):
        engine.step()
        if any(r.spec_token_ids for r in scheduler.running):
            break
    assert any(r.spec_token_ids for r in scheduler.running)
    engine.abort_request(["r0", "r1"])
    engine.step()  # the workers hear of the aborts with the next step
    proposer = inspect(engine).model_runner.proposer
    assert sorted(proposer.finished_ids) == ["r0", "r1"]
    engine.abort_request(["r2"])
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_tensor_parallel_ranks_verify_rank_zeros_drafts(tiny_llama, oracle):
    prompts = random_prompts(4, (5, 30), seed=6, vocab=(100, 1000))
    params = _greedy_params(4, max_tokens=24)
    reference, _ = _run(tiny_llama, prompts, params)
    spec = oracle_spec_config(
        oracle, {",".join(map(str, p)): o.outputs[0].token_ids for p, o in zip(prompts, reference)}
    )
    outputs, stats = _run(tiny_llama, prompts, params, speculative_config=spec, tensor_parallel_size=2, num_threads=1)
    _assert_same(outputs, reference)
    assert stats.spec_decoding.num_accepted_tokens > 0


# ---- configuration and policy ------------------------------------------------------------------------------------
def test_speculative_config_as_vllm_spells_it_and_refusals():
    config = VllmConfig.load(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert config.speculative.method == "ngram" and config.speculative.lookup_range() == (4, 4)
    assert VllmConfig.load().speculative.method == "none" and VllmConfig.load().speculative.lookup_range() == (5, 5)
    with pytest.raises(ConfigError, match="async_scheduling"):
        VllmConfig.load(speculative_method="suffix", async_scheduling=True)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        VllmConfig.load(speculative_config={"method": "ngram", "prompt_lookup_min": 6, "prompt_lookup_max": 3})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        VllmConfig.load(speculative_config="[1]")


def test_an_unknown_proposer_is_refused_with_the_choices(tiny_llama):
    with pytest.raises(ConfigError, match=r"speculative.method: unknown proposer 'eagle'.*ngram.*suffix"):
        LLM(model=tiny_llama, speculative_method="eagle", **COMMON)


def test_dynamic_speculation_drafts_when_memory_bound_and_not_when_compute_bound():
    memory_bound, compute_bound = SpeculationPolicy(), SpeculationPolicy()
    # (tokens, sampled positions): prompt chunks sample little, decode steps sample every token
    for tokens, sampled in ((1, 1), (5, 5), (512, 1), (64, 64), (320, 320), (300, 3), (9, 9), (2, 2), (128, 30)):
        memory_bound.observe_step(tokens, sampled, 0.030 + 0.00005 * tokens + 0.00005 * sampled)  # weights' traffic
        compute_bound.observe_step(tokens, sampled, 0.002 + 0.0006 * tokens + 0.0004 * sampled)  # every token costs
    assert compute_bound.step_cost() == pytest.approx((0.002, 0.0006, 0.0004), rel=1e-6)
    for policy in (memory_bound, compute_bound):
        policy.observe_acceptance(100, 60)
    assert memory_bound.should_speculate(1, 1, 4) and memory_bound.should_speculate(64, 64, 256)
    assert compute_bound.should_speculate(1, 1, 4)  # one request: a is the cost of any step
    assert not compute_bound.should_speculate(64, 64, 256)
    assert sum(compute_bound.should_speculate(64, 64, 256) for _ in range(200)) == 3  # a try every 64 steps
    low = SpeculationPolicy()
    for tokens, sampled in ((1, 1), (5, 5), (512, 1), (64, 64), (9, 9), (2, 2), (128, 30), (300, 3)):
        low.observe_step(tokens, sampled, 0.002 + 0.0006 * tokens + 0.0004 * sampled)
    low.observe_acceptance(100, 2)  # nearly no draft accepted: even one request stops drafting
    assert not low.should_speculate(1, 1, 4)
    assert not SpeculationPolicy(enabled=True).step_cost()


# ---- observability through the server ------------------------------------------------------------------------------
def test_serve_with_speculative_config_reports_vllm_named_counters(make_tiny_model):
    import httpx

    from tests.helpers import Server

    model = make_tiny_model(vocab_size=300)
    server = Server(
        "--model",
        model,
        "--dtype",
        "float32",
        "--layer-kernels",
        "native",
        "--kv-cache-memory",
        "64MiB",
        "--speculative-config",
        '{"method": "suffix", "num_speculative_tokens": 3, "dynamic_speculation": false}',
    )
    try:
        prompt = random_prompts(1, (8, 8), seed=2, vocab=(5, 300))[0] * 3
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("engine_spec_decode") and "_created" not in line
    }
    assert values["engine_spec_decode_num_draft_tokens_total"] > 0, metrics
    assert (
        0
        < values["engine_spec_decode_num_accepted_tokens_total"]
        <= values["engine_spec_decode_num_draft_tokens_total"]
    )
    per_position = [
        line
        for line in metrics.splitlines()
        if line.startswith("engine_spec_decode_num_accepted_tokens_per_pos_total{")
    ]
    assert any('position="0"' in line and 'dp_rank="0"' in line for line in per_position), metrics


# ---- the draft_model proposer --------------------------------------------------------------------------------------
def test_draft_model_proposer_gives_the_plain_greedy_tokens_with_a_good_and_a_poor_draft(tiny_llama, make_tiny_model):
    prompts = random_prompts(4, (5, 40), seed=12, vocab=(100, 1000))
    params = _greedy_params(4, max_tokens=30)
    reference, _ = _run(tiny_llama, prompts, params)
    for draft, good in ((tiny_llama, True), (make_tiny_model(seed=1), False)):
        spec = {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": draft}
        outputs, stats = _run(tiny_llama, prompts, params, speculative_config=spec, max_num_batched_tokens=24)
        _assert_same(outputs, reference)
        rate = stats.spec_decoding.acceptance_rate
        assert (rate > 0.9) if good else (rate < 0.2), (draft, stats.spec_decoding)


def test_draft_model_is_refused_without_a_model_or_with_another_vocabulary(tiny_llama, make_tiny_model):
    with pytest.raises(ConfigError, match="draft_model.*cannot run here: speculative.draft_model names no model"):
        LLM(model=tiny_llama, speculative_method="draft_model", **COMMON)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens"):
        LLM(
            model=tiny_llama,
            speculative_config={"method": "draft_model", "draft_model": make_tiny_model(vocab_size=300)},
            **COMMON,
        )


# ---- SmolLM2 on W2 prompts: every proposer gives the plain greedy tokens --------------------------------------------
@pytest.mark.slow
def test_smollm2_copies_a_w2_prompt_with_every_proposer_and_the_same_tokens():
    from engine_bench.workloads import w2_prompts

    prompts = w2_prompts()[:2]
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=1)
    # float weights: packed products switch kernels by row count, so a verified step (several rows a request) would
    # round unlike a plain decode step (one row)
    common = dict(dtype="float32", quantization="none", kv_cache_memory="256MiB", max_model_len=2048)
    llm = LLM(**common)
    reference = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    from engine.model.model_info import default_model_path

    for spec in (
        {"method": "ngram", "num_speculative_tokens": 5},
        {"method": "suffix", "num_speculative_tokens": 5},
        {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": default_model_path()},
    ):
        llm = LLM(speculative_config=spec, **common)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.get_stats()
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
        _assert_same(outputs, reference)
        assert stats.spec_decoding.acceptance_rate > 0.6, (spec, stats.spec_decoding)
