"""LogitsProcessor interface: acts on the rows of the requests that ask for it."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from engine.interfaces.base import Pluggable


@dataclass
class LogitsRequestView:
    """What a logits processor may read about one request."""

    params: "object"  # SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None


class LogitsProcessor(Pluggable):
    """Changes logits in place for a batch of rows, all belonging to requests that asked for it."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    @classmethod
    @abstractmethod
    def requested_by(cls, params) -> bool:
        """Whether a request with these SamplingParams uses this processor."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: torch.Tensor, requests: list[LogitsRequestView]) -> None:
        """Modify ``logits[rows]`` in place; ``requests[i]`` belongs to ``rows[i]``."""
