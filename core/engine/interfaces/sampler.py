"""Sampler interface: logits of the positions to sample -> token ids."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from engine.interfaces.base import Pluggable


@dataclass
class SamplingMetadata:
    """Per-row sampling settings, as tensors, for one step."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: Optional[torch.Tensor]  # [N] int64, 0 = off; None when no row uses it
    top_p: Optional[torch.Tensor]  # [N] float32, 1 = off; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> seeded generator
    all_greedy: bool
    all_random: bool


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64


class Sampler(Pluggable):
    """Turns processed logits into one token per row."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        ...
