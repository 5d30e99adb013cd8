"""Batched top-k / top-p masking and seeded inverse-CDF sampling."""
from __future__ import annotations

from typing import Optional

import numpy as np
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


def sampling_probs(logits: torch.Tensor, metadata) -> torch.Tensor:
    """[N, V] float32: the distribution each sampled row draws from (temperature, then top-k / top-p).
    Greedy rows get their untempered distribution."""
    from engine.sampling_params import GREEDY_EPS

    temperature = torch.where(metadata.temperature < GREEDY_EPS, 1.0, metadata.temperature)
    logits = apply_top_k_top_p(logits / temperature.unsqueeze(1).to(logits.dtype), metadata.top_k, metadata.top_p)
    return logits.softmax(dim=-1, dtype=torch.float32)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds: np.ndarray, counters: np.ndarray, num_draws: int = 1) -> np.ndarray:
    """[N, num_draws] float64 in [0, 1), a pure function of (seed, counter, draw): counter-based, so a seeded
    request's numbers depend on nothing else in the batch and need no generator state to survive preemption."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.asarray(seeds, dtype=np.int64).view(np.uint64))
        stream = _splitmix64(key ^ np.asarray(counters, dtype=np.uint64))
        bits = _splitmix64(stream[:, None] + np.arange(num_draws, dtype=np.uint64) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def random_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the token where its cumulative distribution passes ``uniform[i]``.

    The cumulative sum runs in float64 so that the tail of a 50k-token vocabulary keeps its mass, and
    a token of probability zero is never chosen (its CDF step is flat).
    """
    cdf = probs.double().cumsum_(dim=-1)
    target = uniform.reshape(-1, 1).to(cdf.device, torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
