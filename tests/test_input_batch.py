"""The model runner's persistent input batch: rows survive steps, holes are filled and condensed, and
every per-row array moves with its request."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.interfaces.logits_processor import LogitsBatch
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import SAMPLING_COLUMNS, CachedRequestState, InputBatch


def make_state(i: int, rng: random.Random) -> CachedRequestState:
    prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
    output = [rng.randrange(1, 500) for _ in range(rng.randrange(0, 10))]
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.3]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        seed=rng.choice([None, i]),
        logprobs=rng.choice([None, 2]),
        presence_penalty=rng.choice([0.0, 0.5]),
    )
    blocks = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 4))] for _ in range(2)]
    return CachedRequestState(
        f"r{i}", prompt, prompt + output, params, blocks, len(prompt) - 1, 2, [params.presence_penalty != 0]
    )


def check_row(batch: InputBatch, state: CachedRequestState) -> None:
    row = batch.req_id_to_index[state.req_id]
    assert batch.req_ids[row] == state.req_id and batch.params[row] is state.sampling_params
    assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == state.token_ids
    assert batch.num_prompt_tokens[row] == len(state.prompt_token_ids)
    assert batch.num_computed_tokens[row] == state.num_computed_tokens
    for table, ids in zip(batch.block_tables, state.block_ids):
        assert table.row_ids(row) == ids
    params = state.sampling_params
    for name in SAMPLING_COLUMNS:
        assert batch.sampling_column(name)[row] == np.array(getattr(params, name), dtype=SAMPLING_COLUMNS[name])
    assert bool(batch.seeded[row]) == (params.seed is not None and not params.greedy)
    assert batch.num_logprobs[row] == (-1 if params.logprobs is None else params.logprobs)
    assert batch.uses_processor[:, row].tolist() == state.processor_mask


def test_rows_stay_contiguous_and_consistent_under_random_churn():
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=16, max_model_len=300, block_sizes=[16, 32], num_processors=1)
    live: dict[str, CachedRequestState] = {}
    next_id = 0
    for _ in range(400):
        for req_id in rng.sample(sorted(live), k=rng.randrange(0, min(4, len(live)) + 1)):
            batch.remove_request(req_id)
            del live[req_id]
        for _ in range(rng.randrange(0, 4)):
            if len(live) < 16:
                state = make_state(next_id, rng)
                next_id += 1
                live[state.req_id] = state
                batch.add_request(state)
        batch.condense()
        assert batch.num_reqs == len(live) and len(batch.req_ids) == len(live)  # rows 0..n-1, no holes
        assert set(batch.req_ids) == set(live)
        # a decode step: every row samples one token and one row gains a block
        rows = np.arange(batch.num_reqs)
        tokens = np.array([rng.randrange(1, 500) for _ in rows], dtype=np.int64)
        batch.append_sampled(rows, tokens)
        for row, token in zip(rows, tokens.tolist()):
            live[batch.req_ids[row]].token_ids.append(token)
        if live:
            req_id = rng.choice(sorted(live))
            new_blocks = [[rng.randrange(1, 1000)], []]
            batch.append_block_ids(batch.req_id_to_index[req_id], new_blocks)
            for ids, new in zip(live[req_id].block_ids, new_blocks):
                ids.extend(new)
        for state in live.values():
            check_row(batch, state)
        check_facts(batch, list(live.values()))


def check_facts(batch: InputBatch, states: list[CachedRequestState]) -> None:
    facts = batch.facts()
    params = [state.sampling_params for state in states]
    assert facts.any_logprobs == any(p.logprobs is not None for p in params)
    assert facts.any_prompt_logprobs == any(p.prompt_logprobs is not None for p in params)
    assert facts.any_processor == any(any(state.processor_mask) for state in states)
    assert facts.any_seeded == any(p.seed is not None and not p.greedy for p in params)


def test_batch_facts_are_kept_while_the_rows_requests_stay_and_renewed_when_they_change():
    """A steady decode batch keeps one BatchFacts object (the runner keys its sampling metadata on it); a request
    that enters, leaves or moves to another row renews it, and the new facts read the rows as they now are."""
    rng = random.Random(1)
    batch = InputBatch(max_num_reqs=8, max_model_len=300, block_sizes=[16], num_processors=1)
    greedy = SamplingParams(temperature=0.0)
    states = [CachedRequestState(f"g{i}", [1, 2, 3], [1, 2, 3], greedy, [[i + 1]], 2, 2, [False]) for i in range(3)]
    for state in states:
        batch.add_request(state)
    facts = batch.facts()
    check_facts(batch, states)
    assert not (facts.any_logprobs or facts.any_prompt_logprobs or facts.any_processor or facts.any_seeded)
    for _ in range(5):  # decode steps: tokens and blocks move on, the requests stay
        rows = np.arange(batch.num_reqs)
        batch.append_sampled(rows, np.array([rng.randrange(1, 500) for _ in rows], dtype=np.int64))
        batch.append_block_ids(0, [[rng.randrange(10, 1000)]])
        batch.condense()
        assert batch.facts() is facts

    wants = SamplingParams(temperature=0.8, seed=7, logprobs=3, prompt_logprobs=1)
    batch.add_request(CachedRequestState("w", [4, 5], [4, 5], wants, [[20]], 1, 2, [True]))
    entered = batch.facts()
    assert entered is not facts
    assert entered.any_logprobs and entered.any_prompt_logprobs and entered.any_processor and entered.any_seeded

    batch.remove_request("w")  # a hole: the facts may still count the removed row until condense moves a row
    batch.remove_request("g0")
    batch.condense()  # g2 moves into row 0
    check_facts(batch, [states[1], states[2]])
    moved = batch.facts()
    assert moved is not entered and batch.facts() is moved


def test_a_request_leaving_the_batch_keeps_its_tokens_and_blocks():
    batch = InputBatch(4, 64, [16], 0)
    state = CachedRequestState("a", [1, 2, 3], [1, 2, 3], SamplingParams(), [[7]], 3, None)
    batch.add_request(state)
    batch.append_sampled(np.array([0]), np.array([9]))
    batch.append_block_ids(0, [[8]])
    batch.remove_request("a", state)  # scheduled out for a step; it comes back later
    assert state.token_ids == [1, 2, 3, 9] and state.block_ids == [[7, 8]]
    batch.condense()
    assert batch.num_reqs == 0 and batch.req_ids == []
    batch.add_request(state)
    check_row(batch, state)


def test_token_array_grows_to_the_context_length_only():
    batch = InputBatch(2, 3000, [16], 0)
    long_prompt = list(range(1, 2500))
    state = CachedRequestState("a", long_prompt, list(long_prompt), SamplingParams(), [[1]], 0, None)
    batch.add_request(state)
    assert batch.token_ids.shape[1] <= 3001
    check_row(batch, state)


def test_logits_batch_reads_tensors_of_the_asking_rows():
    params = [SamplingParams(temperature=0.5, min_p=0.1), SamplingParams(temperature=1.0, min_p=0.2)]
    batch = LogitsBatch.from_requests(params, [[5, 6], [7]], [[8], [9, 10, 11]], eos_token_id=2)
    assert batch.token_ids.tolist() == [[5, 6, 8, 0], [7, 9, 10, 11]]
    assert batch.num_output_tokens.tolist() == [1, 3]
    assert batch.output_tail(1, 2) == [10, 11] and batch.output_tail(0, 5) == [8]
    assert batch.eos_token_ids.tolist() == [2, 2]
    assert batch.column("min_p").tolist() == pytest.approx([0.1, 0.2])
    assert batch.req_ids == ["req-0", "req-1"] and batch.params == params
    assert batch.rows.dtype == torch.int64
