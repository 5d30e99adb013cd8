"""SamplingParams end to end on a tiny Llama: logprobs, penalties, biases, stop strings, n > 1, seeds."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidParameterError
from tests.helpers import assert_all_blocks_free, hf_greedy, random_prompts

PROMPTS = random_prompts(4, (8, 40), seed=21)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_model_len=512)


def generate(llm, prompts, **params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
    return outs


def reference_greedy(hf, prompt, steps, adjust):
    """Greedy decoding with transformers' logits, adjusted per step by ``adjust(logits, prompt, output)``."""
    output: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(adjust(logits, prompt, output).argmax()))
    return output


def test_logprobs_match_transformers_log_softmax(llm, hf_tiny_llama):
    out = generate(llm, PROMPTS[:2], temperature=0, max_tokens=6, logprobs=5)
    for prompt, result in zip(PROMPTS[:2], out):
        completion = result.outputs[0]
        assert len(completion.logprobs) == 6
        context = list(prompt)
        cumulative = 0.0
        for token, position in zip(completion.token_ids, completion.logprobs):
            with torch.no_grad():
                ref = hf_tiny_llama(torch.tensor([context])).logits[0, -1].float().log_softmax(-1)
            top = ref.topk(5)
            assert list(position)[0] == token and position[token].rank == 1  # chosen token first
            assert set(position) == set(top.indices.tolist())
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(position[token_id].logprob - value) < 1e-4
            cumulative += position[token].logprob
            context.append(token)
        assert completion.cumulative_logprob == pytest.approx(cumulative)


def test_sampled_token_rank_and_logprob(llm, hf_tiny_llama):
    completion = generate(llm, PROMPTS[:1], temperature=1.5, max_tokens=8, logprobs=0, seed=3)[0].outputs[0]
    context = list(PROMPTS[0])
    for token, position in zip(completion.token_ids, completion.logprobs):
        with torch.no_grad():
            ref = hf_tiny_llama(torch.tensor([context])).logits[0, -1].float().log_softmax(-1)
        assert list(position) == [token]
        assert abs(position[token].logprob - ref[token].item()) < 1e-4
        assert position[token].rank == int((ref > ref[token]).sum()) + 1
        context.append(token)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_match_transformers(tiny_llama, hf_tiny_llama, chunk):
    llm = LLM(tiny_llama, dtype="float32", **({"max_num_batched_tokens": chunk} if chunk else {}))
    prompt = PROMPTS[3]
    result = generate(llm, [prompt], temperature=0, max_tokens=1, prompt_logprobs=3)[0]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = hf_tiny_llama(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for position, (token, entry) in enumerate(zip(prompt[1:], result.prompt_logprobs[1:])):
        assert list(entry)[0] == token
        assert abs(entry[token].logprob - ref[position, token].item()) < 1e-4
        assert set(ref[position].topk(3).indices.tolist()) <= set(entry)
    assert_all_blocks_free(llm)


def test_repetition_penalty_matches_transformers(llm, hf_tiny_llama):
    out = generate(llm, PROMPTS[:2], temperature=0, max_tokens=12, repetition_penalty=1.8)
    for prompt, result in zip(PROMPTS[:2], out):
        ref = hf_tiny_llama.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=2,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
        ref = ref[: ref.index(2) + 1] if 2 in ref else ref
        assert result.outputs[0].token_ids == ref


def test_frequency_and_presence_penalties_follow_their_formula(llm, hf_tiny_llama):
    def adjust(logits, prompt, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - 0.9 * counts - 1.2 * (counts > 0)

    prompt = PROMPTS[1]
    result = generate(
        llm, [prompt], temperature=0, max_tokens=10, frequency_penalty=0.9, presence_penalty=1.2, ignore_eos=True
    )[0]
    assert result.outputs[0].token_ids == reference_greedy(hf_tiny_llama, prompt, 10, adjust)


def test_logit_bias_allowed_tokens_and_bad_words(llm):
    assert set(
        generate(llm, PROMPTS[:2], temperature=0, max_tokens=5, logit_bias={4242: 100.0})[0].outputs[0].token_ids
    ) == {4242}
    allowed = [500, 600, 700]
    for result in generate(llm, PROMPTS, temperature=1.0, max_tokens=8, allowed_token_ids=allowed, seed=0):
        assert set(result.outputs[0].token_ids) <= set(allowed)
    tok = llm.get_tokenizer()
    plain = generate(llm, PROMPTS[:1], temperature=0, max_tokens=10)[0].outputs[0]
    word = tok.decode(plain.token_ids[:1]).strip() or tok.decode(plain.token_ids[1:2]).strip()
    banned = generate(llm, PROMPTS[:1], temperature=0, max_tokens=10, bad_words=[word])[0].outputs[0]
    assert word not in banned.text and banned.token_ids != plain.token_ids


def test_stop_strings_span_tokens_and_free_blocks(llm):
    plain = generate(llm, PROMPTS[:1], temperature=0, max_tokens=20, ignore_eos=True)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(plain.token_ids[:i]) for i in range(len(plain.token_ids) + 1)]
    # a stop string from the middle of one token's text into the next token's
    cut = next(
        i
        for i in range(2, len(pieces) - 1)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) > len(pieces[i])
    )
    start = len(pieces[cut - 1]) + 1
    stop = plain.text[start : len(pieces[cut]) + 1]
    assert stop and plain.text.find(stop) == start
    out = generate(llm, PROMPTS[:1], temperature=0, max_tokens=20, ignore_eos=True, stop=[stop, "zzzz-never"])[
        0
    ].outputs[0]
    assert out.text == plain.text[:start] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == plain.token_ids[: cut + 1]  # generation ended on the token completing the stop
    kept = generate(
        llm, PROMPTS[:1], temperature=0, max_tokens=20, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )[0].outputs[0]
    assert kept.text == plain.text[: start + len(stop)]
    assert_all_blocks_free(llm)


def test_n_sequences_share_the_prompt_blocks(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=16)
    engine = llm.llm_engine
    prompt = random_prompts(1, (64, 64), seed=22)[0]
    total = llm.get_stats().num_total_blocks
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=5))
    engine.step()
    stats = llm.get_stats()
    # 3 full prompt blocks shared by all four sequences + one own block each (prompt tail + first token)
    assert total - stats.num_free_blocks == 3 + 4, stats
    assert stats.prefix_cache_hits == 3 * 3 * 16
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out
    assert outputs.finished and [c.index for c in outputs.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in outputs.outputs)
    assert len({tuple(c.token_ids) for c in outputs.outputs}) > 1
    again = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=5), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outputs.outputs]  # seeded per sequence
    assert_all_blocks_free(llm)


def test_n_with_greedy_gives_identical_sequences(llm, hf_tiny_llama):
    result = generate(llm, PROMPTS[:1], n=3, temperature=0, max_tokens=6)[0]
    assert [c.token_ids for c in result.outputs] == hf_greedy(hf_tiny_llama, PROMPTS[:1], 6) * 3


def test_seeded_request_alone_and_in_a_batch_of_16(llm):
    prompts = random_prompts(16, (5, 60), seed=23)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, max_tokens=16, seed=777)
    alone = llm.generate([{"prompt_token_ids": prompts[7]}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=t, max_tokens=16 + i) for i, t in enumerate([0.5, 1.0, 0.0, 1.3] * 4)]
    params[7] = seeded
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": {49152: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ],
)
def test_model_dependent_validation(llm, kwargs, field):
    with pytest.raises(InvalidParameterError, match=f"SamplingParams.{field}") as info:
        generate(llm, PROMPTS[:1], **kwargs)
    assert info.value.param == field
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop": "x", "detokenize": False}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
    ],
)
def test_field_validation(kwargs, field):
    with pytest.raises(InvalidParameterError, match=f"SamplingParams.{field}") as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and info.value.code == 400  # the server answers with these, unparsed
