"""Beam search: the ranking rules (unit), parity with transformers' ``generate(num_beams=...)`` on the tiny model,
prefix sharing through the prefix cache, and ``use_beam_search`` in /v1/completions."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import GenerationConfig

from engine import LLM
from engine.beam_search import BeamSearchInstance, BeamSearchParams
from engine.errors import InvalidParameterError
from engine.outputs import Logprob
from tests.helpers import assert_all_blocks_free, random_prompts

EOS = 2


def position(**logprobs: float) -> dict[int, Logprob]:
    return {int(token[1:]): Logprob(value) for token, value in logprobs.items()}


def test_beams_keep_the_best_extensions_and_end_on_eos_among_the_best():
    instance = BeamSearchInstance([9, 9], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    instance.advance([position(t5=-0.1, t2=-0.5, t7=-2.0, t8=-3.0)])  # EOS (2) ranks second: that beam ends
    assert [b.output_token_ids for b in instance.beams] == [[5], [7]]
    assert [b.output_token_ids for b in instance.completed] == [[2]] and instance.completed[0].finish_reason == "stop"
    instance.advance([position(t6=-0.2, t2=-3.0), position(t4=-0.1, t2=-0.2)])  # EOS at rank 3: skipped
    assert [b.output_token_ids for b in instance.beams] == [[5, 6], [7, 4]]
    assert instance.beams[1].cum_logprob == pytest.approx(-2.1)
    instance.advance([position(t1=-0.1), position(t3=-0.1)])
    assert instance.done  # max_tokens reached: the live beams finish by length
    result = instance.result(None).sequences
    # ranked by cum_logprob / length (the prompt counts, a final EOS does not): -0.4 / 5 beats -0.5 / 2 and -2.2 / 5
    assert [b.output_token_ids for b in result] == [[5, 6, 1], [2]]
    assert [b.finish_reason for b in result] == ["length", "stop"]


def test_length_penalty_changes_the_ranking():
    def ranked(length_penalty: float) -> list[list[int]]:
        instance = BeamSearchInstance([9], BeamSearchParams(2, 3, length_penalty=length_penalty), EOS)
        instance.advance([position(t2=-0.6, t5=-0.7)])
        instance.advance([position(t6=-0.1)])
        instance.advance([position(t7=-0.1)])
        return [b.output_token_ids for b in instance.result(None).sequences]

    assert ranked(1.0) == [[5, 6, 7], [2]]  # -0.9 / 4 against -0.6 / 1
    assert ranked(0.0) == [[2], [5, 6, 7]]  # the cumulative log-probabilities alone: -0.6 against -0.9


@pytest.mark.parametrize("kwargs, field", [({"beam_width": 0}, "beam_width"), ({"max_tokens": -1}, "max_tokens")])
def test_bad_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameterError) as info:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert info.value.param == field


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(tiny_llama, dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


def hf_beams(model, prompt: list[int], beam_width: int, max_tokens: int) -> tuple[list[list[int]], list[float]]:
    config = GenerationConfig(
        num_beams=beam_width,
        num_return_sequences=beam_width,
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        length_penalty=1.0,
        early_stopping=False,
    )
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=config,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequences = [row[len(prompt) :].tolist() for row in out.sequences]
    return sequences, [float(score) * max_tokens for score in out.sequences_scores]  # cumulative log-probabilities


def test_beam_search_equals_transformers(llm, hf_tiny_llama):
    prompts = random_prompts(3, (6, 20), seed=4)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, 8, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        expected, expected_cum = hf_beams(hf_tiny_llama, prompt, 3, 8)
        ours = [beam.output_token_ids for beam in result.sequences]
        cum = [beam.cum_logprob for beam in result.sequences]
        assert cum == pytest.approx(expected_cum, abs=2e-3)
        if ours != expected:  # the parity rule's fallback: only beams whose scores tie may swap places
            for a, b, score in zip(ours, expected, cum):
                assert a == b or any(abs(score - other) < 2e-3 for other in cum if other is not score), (ours, expected)
        assert all(beam.text == llm.get_tokenizer().decode(beam.output_token_ids) for beam in result.sequences)
    assert_all_blocks_free(llm)


def test_beams_share_their_prefix_through_the_prefix_cache(llm):
    before = llm.get_stats()
    llm.beam_search({"prompt_token_ids": random_prompts(1, (64, 64), seed=8)[0]}, BeamSearchParams(4, 6, True))
    after = llm.get_stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits > 0.5 * (
        after.prefix_cache_queries - before.prefix_cache_queries
    )
    assert_all_blocks_free(llm)


def test_use_beam_search_in_completions(features_server, llm):
    prompt = random_prompts(1, (10, 10), seed=3)[0]
    body = {"prompt": prompt, "max_tokens": 6, "n": 3, "use_beam_search": True, "ignore_eos": True}
    response = httpx.post(features_server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    offline = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(3, 6, ignore_eos=True))[0]
    assert [c["text"] for c in response.json()["choices"]] == [beam.text for beam in offline.sequences]
    assert response.json()["usage"]["completion_tokens"] == 18
    for bad, param in (({"n": 0}, "n"), ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs")):
        refused = httpx.post(features_server.url + "/v1/completions", json={**body, **bad}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
