"""The rejection sampler: which draft tokens the target model keeps, and the token that follows them.

Greedy rows keep drafts while they equal the target's argmax, then take the target's token. Sampled rows
use the standard rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft ``d`` drawn
from ``q`` is accepted with probability ``min(1, p(d) / q(d))``; the first rejected position draws its token
from ``max(0, p - q)`` normalised; when every draft is accepted, the bonus token is drawn from ``p`` at the
next position. Each emitted token is then distributed exactly as plain sampling from ``p`` would give.

The target distributions are asked for lazily (``target_probs(rows, positions)``): the acceptance test needs
``p(d)`` at the drafts of sampled rows only, and the recovery a whole distribution at one position per row
that rejected, so a large vocabulary costs a few rows of probabilities, not rows x drafts.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.sample.ops import random_sample

# (batch rows, positions) -> [len(rows), V] float probabilities of the target at those positions
TargetProbs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_token_ids: torch.Tensor,
    greedy: torch.Tensor,
    target_probs: Optional[TargetProbs | torch.Tensor] = None,
    draft_probs: Optional[torch.Tensor] = None,
    uniform: Optional[torch.Tensor] = None,
) -> list[list[int]]:
    """The tokens each row emits: its accepted drafts followed by one more token.

    draft_token_ids:  [R, K] int64, row r's drafts in columns < num_draft_tokens[r] (the rest is padding)
    num_draft_tokens: [R] int64
    target_token_ids: [R, K + 1] int64, the sampler's token at each position (argmax for greedy rows; for
                      sampled rows only the bonus positions are read: a draw from p there)
    greedy:           [R] bool
    target_probs:     p, as a [R, K + 1, V] tensor or a function of (rows, positions) (needed when a row samples)
    draft_probs:      [R, K, V] float, q (None: every draft was a deterministic guess, q = point mass)
    uniform:          [R, K, 2] float64 in [0, 1): per position, the acceptance draw and the recovery draw
    """
    probs_at: Optional[TargetProbs] = None
    if isinstance(target_probs, torch.Tensor):
        table = target_probs
        probs_at = lambda rows, positions: table[rows, positions]
    elif target_probs is not None:
        probs_at = target_probs
    num_rows, max_drafts = draft_token_ids.shape
    positions = torch.arange(max_drafts).unsqueeze(0)
    valid = positions < num_draft_tokens.unsqueeze(1)
    accepted = (draft_token_ids == target_token_ids[:, :max_drafts]) & valid  # greedy rule
    sampled_rows = (~greedy).nonzero().squeeze(1)
    recovered: dict[int, int] = {}
    if len(sampled_rows) and max_drafts:
        if probs_at is None or uniform is None:
            raise ValueError("rows that sample need target_probs and uniform")
        sub_valid = valid[sampled_rows]
        rows, cols = sub_valid.nonzero(as_tuple=True)  # every draft position of the sampled rows
        batch_rows = sampled_rows[rows]
        drafts = draft_token_ids[batch_rows, cols]
        p_draft = probs_at(batch_rows, cols).double().gather(1, drafts.unsqueeze(1)).squeeze(1)
        q_draft = (
            torch.ones_like(p_draft)
            if draft_probs is None
            else draft_probs[batch_rows, cols].double().gather(1, drafts.unsqueeze(1)).squeeze(1)
        )
        accept = torch.zeros(len(sampled_rows), max_drafts, dtype=torch.bool)
        accept[rows, cols] = uniform[batch_rows, cols, 0] * q_draft < p_draft  # u < p/q without dividing by q = 0
        accepted[sampled_rows] = accept
        # the first rejected position of each sampled row that rejected one: its token from max(0, p - q)
        num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
        rejecting = (num_accepted < num_draft_tokens[sampled_rows]).nonzero().squeeze(1)
        if len(rejecting):
            rows_b, at = sampled_rows[rejecting], num_accepted[rejecting]
            p = probs_at(rows_b, at).double()
            d = draft_token_ids[rows_b, at].unsqueeze(1)
            residual = (
                p.scatter(1, d, 0.0) if draft_probs is None else (p - draft_probs[rows_b, at].double()).clamp_(min=0)
            )
            residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)  # p == q: any draw of p
            drawn = random_sample(residual, uniform[rows_b, at, 1])
            recovered = dict(zip(rows_b.tolist(), drawn.tolist()))
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
    emitted = []
    for row, n in enumerate(num_accepted.tolist()):
        tokens: list[int] = draft_token_ids[row, :n].tolist()
        if n < int(num_draft_tokens[row]):
            tokens.append(recovered.get(row, int(target_token_ids[row, n])))
        else:
            tokens.append(int(target_token_ids[row, n]))
        emitted.append(tokens)
    return emitted
