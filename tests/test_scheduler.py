"""Scheduler: token budget, chunked prefill, preemption, stop rules, abort — with a fake runner."""

from __future__ import annotations

import torch

from engine.config import VllmConfig
from engine.kv_cache.coordinators import UnitaryKVCacheCoordinator
from engine.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ModelRunnerOutput
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, max_model_len=128, **config) -> Scheduler:
    spec = FullAttentionSpec(BS, 1, 4, torch.float32)
    kv = KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l0",), spec),))
    return Scheduler(VllmConfig.load(**config), kv, UnitaryKVCacheCoordinator, max_model_len)


def add(scheduler, rid, n_prompt, **params) -> Request:
    start = 100 * (len(scheduler.requests) + 1)  # distinct prompts: no prefix-cache hits between them
    request = Request(rid, list(range(start, start + n_prompt)), SamplingParams(**params), EOS, BS)
    scheduler.add_request(request)
    return request


def step(scheduler, token=5):
    """Schedule, then 'sample' ``token`` for every request that reached the end of its tokens."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [token] if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens else []
        for r in req_ids
    ]
    return out, scheduler.update_from_output(out, ModelRunnerOutput(req_ids, sampled))


def test_token_budget_and_chunked_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, "a", 7, max_tokens=3), add(scheduler, "b", 12, max_tokens=3)
    out, results = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 7, "b": 3}  # b's prompt is chunked
    assert [r.request_id for r in results] == ["a"]
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    out, results = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_no_chunking_waits_for_budget():
    scheduler = make_scheduler(max_num_batched_tokens=200, enable_chunked_prefill=False)
    add(scheduler, "a", 7)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 7}


def test_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        add(scheduler, rid, 4)
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["a", "b"] and len(scheduler.waiting) == 1


def test_preemption_by_recompute_and_resume():
    scheduler = make_scheduler(num_blocks=8, max_model_len=32)
    a, b = (
        add(scheduler, "a", 8, max_tokens=12, ignore_eos=True),
        add(scheduler, "b", 8, max_tokens=12, ignore_eos=True),
    )
    for _ in range(9):  # after 9 steps both hold 4 blocks (16 slots) and all 8 are taken
        out, _ = step(scheduler)
    assert b.status == RequestStatus.RUNNING
    out, _ = step(scheduler)  # a needs a 5th block: b, the latest arrival, is preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" in out.finished_req_ids  # the workers drop it until it is rescheduled
    pool = scheduler.kv_cache_manager.block_pool
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        resumed = [n for n in out.scheduled_new_reqs if n.req_id == "b"]
        if resumed:
            assert resumed[0].output_token_ids == b.output_token_ids[:-1]  # recomputes prompt + outputs so far
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12 and b.num_preemptions >= 1
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_async_scheduling_stops_scheduling_at_max_tokens_counting_steps_in_flight():
    """A request whose steps in flight will already produce its last token is not scheduled again."""
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, "a", 5, max_tokens=2, ignore_eos=True)
    first = scheduler.schedule()  # the prompt: samples token 1 (in flight)
    second = scheduler.schedule()  # token 2, before token 1 is known
    third = scheduler.schedule()  # nothing: the two steps in flight produce both tokens
    assert first.num_scheduled_tokens == {"a": 5} and second.num_scheduled_tokens == {"a": 1}
    assert third.num_scheduled_tokens == {}
    for out in (first, second, third):
        scheduler.update_from_output(
            out, ModelRunnerOutput(list(out.num_scheduled_tokens), [[7]] * len(out.num_scheduled_tokens))
        )
    assert not scheduler.has_unfinished_requests()


def test_stop_rules():
    scheduler = make_scheduler()
    eos = add(scheduler, "eos", 3, max_tokens=10)
    ignored = add(scheduler, "ignored", 3, max_tokens=2, ignore_eos=True)
    step(scheduler, token=EOS)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [EOS]
    assert not ignored.is_finished()
    step(scheduler, token=EOS)
    assert ignored.status == RequestStatus.FINISHED_LENGTH_CAPPED

    scheduler = make_scheduler()
    early = add(scheduler, "m", 3, max_tokens=10, min_tokens=2, stop_token_ids=[9])
    step(scheduler, token=9)
    assert not early.is_finished()  # below min_tokens
    _, results = step(scheduler, token=9)
    assert early.status == RequestStatus.FINISHED_STOPPED and results[0].stop_reason == 9
    assert results[0].finish_reason == "stop"


def test_max_model_len_caps_length():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 126, max_tokens=50, ignore_eos=True)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and request.num_tokens == 128


def test_abort_frees_blocks_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "run", 9)
    add(scheduler, "wait", 9)
    step(scheduler)
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks and not scheduler.has_unfinished_requests()
    assert set(scheduler.schedule().finished_req_ids) == {"run", "wait"}


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits():
    scheduler = make_scheduler(max_num_batched_tokens=128, enable_chunked_prefill=False)
    add(scheduler, "a", 7, max_tokens=3, ignore_eos=True)
    add(scheduler, "c", 7, max_tokens=3, ignore_eos=True)
    step(scheduler)
    big = add(scheduler, "big", 127, max_tokens=1)
    out, _ = step(scheduler)  # a and c decode (2 tokens): 126 left, big needs 127
    assert out.num_scheduled_tokens == {"a": 1, "c": 1} and big.num_computed_tokens == 0
    scheduled = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        scheduled.append(out.num_scheduled_tokens.get("big"))
    assert [n for n in scheduled if n] == [127]  # all at once, never chunked


def test_isolated_requests_run_one_per_step_until_each_has_sampled():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a, b, c = (add(scheduler, rid, 6, max_tokens=4, ignore_eos=True) for rid in "abc")
    step(scheduler)  # a and b prefill, c is chunked
    scheduler.isolate(["a", "b", "c"])  # as the engine core does after a failed step
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in (a, b, c))
    seen = []
    for _ in range(3):
        out, _ = step(scheduler)
        seen.append(list(out.num_scheduled_tokens))
        if len(seen) == 1:  # the workers are told to drop what they hold of the rolled-back requests
            assert set(out.finished_req_ids) == {"a", "b", "c"}
    assert seen == [["a"], ["b"], ["c"]]  # each alone, each prefilled and sampled, then released
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"] and not scheduler.isolated


def test_failed_requests_free_their_blocks_and_leave_isolation():
    scheduler = make_scheduler()
    add(scheduler, "bad", 9)
    add(scheduler, "good", 9, max_tokens=2, ignore_eos=True)
    step(scheduler)
    scheduler.isolate(["bad", "good"])
    outputs = scheduler.fail_requests(["bad", "unknown"], "RuntimeError: boom")
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [("bad", "error", "RuntimeError: boom")]
    assert list(scheduler.isolated) == ["good"]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks and not scheduler.isolated


def add_with_priority(scheduler, rid, n_prompt, priority, **params) -> Request:
    start = 100 * (len(scheduler.requests) + 1)
    request = Request(rid, list(range(start, start + n_prompt)), SamplingParams(**params), EOS, BS, priority=priority)
    scheduler.add_request(request)
    return request


def first_scheduled_order(scheduler) -> list[str]:
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        order += [n.req_id for n in out.scheduled_new_reqs if n.req_id not in order]
    return order


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1)]:
        add_with_priority(scheduler, rid, 4, priority, max_tokens=2)
    assert first_scheduled_order(scheduler) == ["d", "b", "a", "c"]


def test_fcfs_policy_keeps_arrival_order_whatever_the_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    for rid, priority in [("a", 5), ("b", 0), ("c", 5)]:
        add_with_priority(scheduler, rid, 4, priority, max_tokens=2)
    assert first_scheduled_order(scheduler) == ["a", "b", "c"]


def test_priority_policy_a_waiting_request_preempts_lower_priority_running_ones_when_the_cache_is_full():
    scheduler = make_scheduler(num_blocks=8, max_model_len=32, policy="priority")
    low = add_with_priority(scheduler, "low", 16, 10, max_tokens=12, ignore_eos=True)
    for _ in range(3):
        step(scheduler)
    assert low.status == RequestStatus.RUNNING  # 16 prompt + 2 tokens: 5 of the 8 blocks
    high = add_with_priority(scheduler, "high", 16, 0, max_tokens=4, ignore_eos=True)  # needs 4 blocks: only 3 free
    out, _ = step(scheduler)
    assert low.status == RequestStatus.PREEMPTED and "low" in out.preempted_req_ids
    assert [n.req_id for n in out.scheduled_new_reqs] == ["high"] and "low" not in out.num_scheduled_tokens
    while high.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        out, _ = step(scheduler)
        assert "low" not in out.num_scheduled_tokens or high.is_finished()
    pool = scheduler.kv_cache_manager.block_pool
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # nothing lost: the preempted request resumed and produced all its tokens; every block came back
    assert low.num_output_tokens == 12 and high.num_output_tokens == 4 and low.num_preemptions == 1
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_priority_policy_does_not_preempt_for_an_equal_or_lower_priority_request():
    scheduler = make_scheduler(num_blocks=8, max_model_len=32, policy="priority")
    first = add_with_priority(scheduler, "first", 16, 1, max_tokens=12, ignore_eos=True)
    for _ in range(3):
        step(scheduler)
    later = add_with_priority(scheduler, "later", 16, 1, max_tokens=4, ignore_eos=True)
    step(scheduler)
    assert first.status == RequestStatus.RUNNING and later.status == RequestStatus.WAITING


def test_priority_policy_preempts_the_lowest_priority_running_request_not_the_latest_admitted():
    scheduler = make_scheduler(num_blocks=8, max_model_len=32, policy="priority")
    low = add_with_priority(scheduler, "low", 8, 9, max_tokens=12, ignore_eos=True)
    high = add_with_priority(scheduler, "high", 8, 0, max_tokens=12, ignore_eos=True)
    for _ in range(9):  # both hold 4 blocks: the pool is full
        step(scheduler)
    assert low.status == high.status == RequestStatus.RUNNING
    out, _ = step(scheduler)  # one needs a 5th block: the low-priority one (admitted first) is preempted
    assert low.status == RequestStatus.PREEMPTED and high.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens.get("high") == 1 and "low" not in out.num_scheduled_tokens
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert low.num_output_tokens == high.num_output_tokens == 12
