"""Shared test helpers: transformers references, random prompts, pool checks."""
from __future__ import annotations

import torch


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = 2) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), cut after the first EOS."""
    results = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id)[0, len(ids):].tolist()
        if eos_token_id is not None and eos_token_id in out:
            out = out[: out.index(eos_token_id) + 1]
        results.append(out)
    return results


def random_prompts(n: int, lengths: tuple[int, int], seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out.append(torch.randint(vocab[0], vocab[1], (length,), generator=gen).tolist())
    return out


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
