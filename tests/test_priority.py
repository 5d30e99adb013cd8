"""Priority scheduling (``scheduler.policy: priority``) through the whole engine: order, preemption, nothing lost."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import assert_all_blocks_free, random_prompts


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, (20, 40), seed=5)


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    return outputs


def test_requests_finish_in_priority_order_one_at_a_time(tiny_llama, prompts, alone):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    priorities = [3, 0, 7, -2, 3, 1]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params, priority=r) for p, r in zip(prompts, priorities)]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    by_priority = sorted(range(len(ids)), key=lambda i: (priorities[i], i))  # ties: arrival order
    assert [o.request_id for o in finished] == [ids[i] for i in by_priority]
    assert {o.request_id: o.outputs[0].token_ids for o in finished} == dict(zip(ids, alone))
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_a_tight_cache_preempts_low_priorities_and_loses_nothing(tiny_llama, prompts, alone):
    tight = LLM(
        tiny_llama,
        dtype="float32",
        max_model_len=128,
        scheduling_policy="priority",
        max_num_batched_tokens=16,
        num_gpu_blocks_override=10,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = tight.generate(prompts, params, use_tqdm=False, priority=[5, 4, 3, 2, 1, 0])
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert_all_blocks_free(tight)
    tight.shutdown()


def test_a_priority_needs_the_priority_policy(tiny_llama, prompts):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    assert_all_blocks_free(llm)
    llm.shutdown()
