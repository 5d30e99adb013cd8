"""Batched top-k / top-p masking and seeded inverse-CDF sampling."""
from __future__ import annotations

from typing import Optional

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. k=0 and p=1 mean off."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - top_p).unsqueeze(1)
        outside[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row, found in the row's cumulative distribution.

    The cumulative sum runs in float64 so that the tail of a 50k-token vocabulary keeps its mass, and
    a token of probability zero is never chosen (its CDF step is flat). Rows with their own generator
    draw only from it, so a seeded request gets the same token whatever else shares its batch.
    """
    rows = probs.shape[0]
    uniform = torch.empty(rows, 1, dtype=torch.float64, device=probs.device)
    if len(generators) < rows:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    cdf = probs.double().cumsum_(dim=-1)
    target = uniform * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
