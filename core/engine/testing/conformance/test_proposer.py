"""A proposer drafts within the limits it is given, forgets finished requests, and an engine using it gives
transformers' greedy tokens (the target model verifies every draft) with every KV block back in the pool."""

from __future__ import annotations

import numpy as np

from engine.testing.conformance.conftest import implementation
from engine.testing.models import hf_greedy, random_prompts


def _batch(sequences: list[list[int]], max_num_drafts: list[int], num_prompt: list[int]):
    from engine.interfaces.proposer import ProposalBatch

    width = max(len(s) for s in sequences) + 8
    rows = np.zeros((len(sequences), width), dtype=np.int32)
    for i, tokens in enumerate(sequences):
        rows[i, : len(tokens)] = tokens
    return ProposalBatch(
        [f"r{i}" for i in range(len(sequences))],
        np.array(num_prompt, dtype=np.int64),
        np.array(max_num_drafts, dtype=np.int64),
        rows,
        np.arange(len(sequences)),
        np.array([len(s) for s in sequences], dtype=np.int64),
    )


def test_drafts_stay_within_each_rows_limit(proposer_name, tiny_model):
    from engine.config import VllmConfig

    impl = implementation("proposer", proposer_name, model=tiny_model)  # skips when no proposer is named
    config = VllmConfig.load(
        model=tiny_model, speculative_config={"method": proposer_name, "num_speculative_tokens": 3}
    )
    proposer = impl.create(config)
    pattern = [101, 102, 103, 104, 105, 106]
    sequences = [pattern * 4, pattern * 4 + [101, 102], [7, 8, 9], pattern * 3]
    limits = [3, 2, 3, 0]
    for _ in range(2):  # a second call sees the same requests grown by nothing: state kept per request is reused
        drafts = proposer.propose(_batch(sequences, limits, [6, 6, 3, 6]))
        assert len(drafts) == len(sequences)
        for tokens, limit in zip(drafts, limits):
            assert len(tokens) <= limit and all(isinstance(int(t), int) and 0 <= int(t) for t in tokens)
    proposer.finished([f"r{i}" for i in range(len(sequences))])


def test_an_engine_with_the_proposer_gives_transformers_tokens(proposer_name, tiny_model, hf_tiny_model):
    from engine import LLM, SamplingParams

    implementation("proposer", proposer_name, model=tiny_model)
    prompts = [p * 3 for p in random_prompts(4, (4, 12), seed=7)]
    llm = LLM(
        tiny_model,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,
        speculative_config={"method": proposer_name, "num_speculative_tokens": 3, "dynamic_speculation": False},
    )
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_tiny_model, prompts, 16)
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_running_reqs, stats
        assert stats.spec_decoding is not None
    finally:
        llm.shutdown()
