"""The offline LLM API: inputs, outputs, stop rules, sampling, abort, validation."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing import inspect
from tests.helpers import assert_all_blocks_free, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_model_len=256)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello there, how are you")
    outs = llm.generate(
        ["Hello there, how are you", ids, {"prompt_token_ids": ids}, {"prompt": "Hello there, how are you"}],
        SamplingParams(temperature=0, max_tokens=5),
        use_tqdm=False,
    )
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == "Hello there, how are you" and outs[1].prompt is None
    completion = outs[0].outputs[0]
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    expected = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected and "<|im_start|>assistant" in tok.decode(expected)


def test_stop_token_ids_and_min_tokens(llm, hf_tiny_llama):
    prompt = random_prompts(1, (20, 20), seed=4)[0]
    greedy = hf_greedy(hf_tiny_llama, [prompt], 8, eos_token_id=None)[0]
    stop = greedy[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == greedy[: greedy.index(stop) + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=5, stop_token_ids=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert stop not in out.token_ids[:5] and len(out.token_ids) >= 5


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompts = random_prompts(9, (5, 40), seed=6)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=12)] * 8
    batch = llm.generate(prompts, [seeded] + others, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batch
    other_seed = (
        llm.generate([prompts[0]], SamplingParams(temperature=1.0, max_tokens=12, seed=99), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_seeded_requests_keep_their_tokens_through_preemption_and_skipped_steps(llm, tiny_llama):
    """A tight engine (8 tokens a step, 10 KV blocks) preempts and leaves running requests out of steps, so
    rows leave and re-enter the runner's persistent batch; seeded requests, with every sampling setting
    and logits processor in play, give the tokens they give alone in a roomy engine."""
    prompts = random_prompts(6, (20, 40), seed=11)
    params = [
        SamplingParams(
            temperature=0.9,
            max_tokens=40,
            seed=i,
            ignore_eos=True,
            top_k=[0, 20][i % 2],
            top_p=[1.0, 0.9][i % 3 == 0],
            min_p=[0.0, 0.05][i % 2],
            presence_penalty=0.3 * (i % 3),
            repetition_penalty=[1.0, 1.2][i % 2],
            min_tokens=3,
            bad_words_token_ids=[[prompts[i][0]]],
        )
        for i in range(6)
    ]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    tight = LLM(tiny_llama, dtype="float32", max_model_len=128, max_num_batched_tokens=8, num_gpu_blocks_override=10)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.get_stats().num_preemptions > 0
    assert together == alone
    assert_all_blocks_free(tight)


def test_sampling_metadata_is_kept_through_a_steady_batch_and_renewed_when_a_request_joins(llm):
    """The runner keeps a steady decode batch's sampling metadata from step to step (as vLLM's input batch does);
    a request joining or leaving renews it, so the sampler always sees every row's own settings and a joining
    request that wants logprobs gets them from its first token."""
    runner = inspect(llm).model_runner
    seen = []
    sampler = runner.sampler

    def recording(logits, metadata):
        seen.append((metadata, metadata.temperature.tolist(), metadata.top_k))
        return sampler(logits, metadata)

    runner.sampler = recording
    engine = llm.llm_engine
    try:
        prompts = random_prompts(2, (6, 12), seed=3)
        engine.add_request({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=8), "a")
        for _ in range(4):  # the prompt, then three decode steps of "a" alone
            engine.step()
        alone = seen[1:]
        assert all(entry[0] is alone[0][0] for entry in alone) and alone[0][1] == [0.0]
        joins = SamplingParams(temperature=0.7, top_k=5, logprobs=2, max_tokens=10)
        engine.add_request({"prompt_token_ids": prompts[1]}, joins, "b")
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    finally:
        runner.sampler = sampler
    together = [entry for entry in seen[4:] if len(entry[1]) == 2]
    assert together and sorted(together[0][1]) == pytest.approx([0.0, 0.7])
    assert together[0][2] is not None and sorted(together[0][2].tolist()) == [0, 5]
    assert together[0][0] is not alone[0][0]
    b_alone = [entry for entry in seen[4:] if len(entry[1]) == 1]
    assert b_alone and b_alone[-1][1] == pytest.approx([0.7]), "after 'a' finished the metadata is b's own"
    b = outputs["b"].outputs[0]
    assert len(b.token_ids) == 10 and len(b.logprobs) == 10 and all(len(step) >= 2 for step in b.logprobs)
    assert_all_blocks_free(llm)


def test_top_k_one_is_greedy(llm):
    prompts = random_prompts(3, (5, 30), seed=7)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_abort_returns_every_block(llm):
    engine = llm.llm_engine
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
        for p in random_prompts(5, (30, 90), seed=8)
    ]
    for _ in range(3):
        engine.step()
    assert llm.get_stats().num_free_blocks < llm.get_stats().num_total_blocks
    aborted = engine.abort_request(ids)
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"] * 5
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "the prompt is empty"),
        ([5] * 256, "context length is 256"),
        ([49152], "out of the vocabulary"),
    ],
)
def test_bad_prompts_are_rejected_and_nothing_leaks(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[10, 11], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_a_shut_down_llm_is_collected_with_its_weights(tiny_llama):
    """The engine freezes its start-up heap out of the garbage collector's sight (as vLLM does); shutting it
    down must undo that, or every LLM built and dropped in a long-lived process keeps its weights for good."""
    import gc
    import weakref

    llm = LLM(tiny_llama, dtype="float32", max_model_len=128)
    llm.generate([[10, 11, 12]], SamplingParams(max_tokens=2), use_tqdm=False)
    model = inspect(llm).model
    weights = weakref.ref(next(model.parameters()))
    engine = weakref.ref(llm.llm_engine)
    del model
    llm.shutdown()
    del llm
    gc.collect()
    assert engine() is None, "the shut-down engine is still alive"
    assert weights() is None, "the shut-down engine's weights are still alive"
    assert gc.get_freeze_count() == 0
