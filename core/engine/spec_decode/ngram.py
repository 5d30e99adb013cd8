"""The ``ngram`` proposer (prompt lookup): continue the request as it continued after an earlier occurrence
of its last n tokens."""

from __future__ import annotations

import numpy as np

from engine.hookspecs import hookimpl
from engine.interfaces.proposer import ProposalBatch, Proposer


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to ``num_drafts`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``tokens`` with a length in [min_n, max_n]; [] when no such suffix occurred before."""
    total = len(tokens)
    if num_drafts <= 0 or total <= min_n:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        # windows[i] = tokens[i:i+n] for i < total - n (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        candidates = np.nonzero(windows[:, 0] == suffix[0])[0]
        if len(candidates):
            candidates = candidates[(windows[candidates] == suffix).all(axis=1)]
        if len(candidates):
            start = int(candidates[-1]) + n  # the latest occurrence: the nearest context repeats best
            return tokens[start : start + num_drafts].tolist()
    return []


class NgramProposer(Proposer):
    """vLLM's ``ngram`` method: prompt lookup over the request's prompt and output so far."""

    name = "ngram"
    priority = 20

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.min_n, self.max_n = vllm_config.speculative.lookup_range()

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        return [
            find_ngram_continuation(batch.token_ids(i), self.min_n, self.max_n, int(batch.max_num_drafts[i]))
            for i in range(len(batch))
        ]


@hookimpl
def engine_spec_proposers():
    return [NgramProposer]
