"""Batched top-k / top-p masking and inverse-CDF sampling (the seeded numbers: ``engine.interfaces.sampler``)."""

from __future__ import annotations

from typing import Optional

import torch

from engine.sampling_params import GREEDY_EPS


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
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


def sampling_probs(logits: torch.Tensor, metadata) -> torch.Tensor:
    """[N, V] float32: the distribution each sampled row draws from (temperature, then top-k / top-p).
    Greedy rows get their untempered distribution."""
    temperature = torch.where(metadata.temperature < GREEDY_EPS, 1.0, metadata.temperature)
    logits = apply_top_k_top_p(logits / temperature.unsqueeze(1).to(logits.dtype), metadata.top_k, metadata.top_p)
    return logits.softmax(dim=-1, dtype=torch.float32)


def random_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the token where its cumulative distribution passes ``uniform[i]``.

    The cumulative sum runs in float64 so that the tail of a 50k-token vocabulary keeps its mass, and
    a token of probability zero is never chosen (its CDF step is flat).
    """
    cdf = probs.double().cumsum_(dim=-1)
    target = uniform.reshape(-1, 1).to(cdf.device, torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
