"""Sampler interface: logits of the positions to sample -> token ids."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.config import VllmConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    mixed: np.ndarray = z ^ (z >> np.uint64(31))
    return mixed


def seeded_uniform(seeds: np.ndarray, counters: np.ndarray, num_draws: int = 1) -> np.ndarray:
    """[N, num_draws] float64 in [0, 1), a pure function of (seed, counter, draw): counter-based, so a seeded
    request's numbers depend on nothing else in the batch and need no generator state to survive preemption."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.asarray(seeds, dtype=np.int64).view(np.uint64))
        stream = _splitmix64(key ^ np.asarray(counters, dtype=np.uint64))
        bits = _splitmix64(stream[:, None] + np.arange(num_draws, dtype=np.uint64) * _GOLDEN)
    uniform: np.ndarray = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return uniform


@dataclass
class SamplingMetadata:
    """The sampling rows of one step, as tensors: row i of every field is row i of the logits.

    Contract 1.3. Seeded rows draw their random numbers from ``uniform()``, a pure function of the
    request's seed and how many tokens it has produced, so a seeded request gives the same tokens
    whatever else shares its batch and after a preemption.
    """

    temperature: torch.Tensor  # [N] float32; below 1e-5 means greedy
    top_k: Optional[torch.Tensor]  # [N] int64, 0 = off; None when no row uses it
    top_p: Optional[torch.Tensor]  # [N] float32, 1 = off; None when no row uses it
    all_greedy: bool
    all_random: bool
    req_ids: list[str] = field(default_factory=list)
    seeds: Optional[torch.Tensor] = None  # [N] int64, meaningful where ``seeded``; None when no row is seeded
    seeded: Optional[torch.Tensor] = None  # [N] bool
    output_index: Optional[torch.Tensor] = None  # [N] int64: tokens each row has produced before this one

    def uniform(self, num_draws: int = 1) -> torch.Tensor:
        """[N, num_draws] float64 in [0, 1): seeded rows from (seed, output_index, draw), the others from
        torch's global generator."""
        draws = torch.rand(len(self.temperature), num_draws, dtype=torch.float64)
        if self.seeded is not None and bool(self.seeded.any()):
            assert self.seeds is not None and self.output_index is not None
            rows = self.seeded.nonzero().squeeze(1)
            draws[rows] = torch.from_numpy(
                seeded_uniform(self.seeds[rows].numpy(), self.output_index[rows].numpy(), num_draws)
            )
        return draws


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64


class Sampler(Pluggable):
    """Turns processed logits into one token per row.

    Constructed once per worker as ``cls(vllm_config)``; called once per step with the logits of the rows
    that sample (already changed by the logits processors) and their ``SamplingMetadata``.
    """

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config

    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput: ...
