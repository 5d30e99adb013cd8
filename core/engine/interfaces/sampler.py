"""Sampler interface: logits of the positions to sample -> token ids."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.interfaces.base import Pluggable
from engine.sample.ops import seeded_uniform


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
            rows = self.seeded.nonzero().squeeze(1)
            draws[rows] = torch.from_numpy(seeded_uniform(self.seeds[rows].numpy(),
                                                          self.output_index[rows].numpy(), num_draws))
        return draws


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64


class Sampler(Pluggable):
    """Turns processed logits into one token per row.

    Constructed once per worker as ``cls(vllm_config)``; called once per step with the logits of the rows
    that sample (already changed by the logits processors) and their ``SamplingMetadata``.
    """

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        ...
