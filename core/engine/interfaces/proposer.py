"""Proposer interface: drafts tokens that the target model verifies (speculative decoding)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.config import VllmConfig


@dataclass
class ProposalBatch:
    """The rows that just sampled, after their new tokens were appended (contract 1.6).

    ``token_ids(i)`` is row i's prompt followed by every output token so far (a read-only numpy view, valid
    only during ``propose``); a proposer returns at most ``max_num_drafts[i]`` drafts for it (0: none wanted,
    e.g. the request is about to reach ``max_tokens`` or the context length).
    """

    req_ids: list[str]
    num_prompt_tokens: np.ndarray  # [n] int64
    max_num_drafts: np.ndarray  # [n] int64
    _token_rows: np.ndarray  # the runner's persistent token matrix, one row per request
    _batch_rows: np.ndarray
    _num_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.req_ids)

    def token_ids(self, i: int) -> np.ndarray:
        return self._token_rows[self._batch_rows[i], : self._num_tokens[i]]


class Proposer(Pluggable):
    """Drafts up to ``speculative.num_speculative_tokens`` tokens per request and step.

    Constructed once per worker as ``cls(vllm_config)``. Only rank 0 proposes: the scheduler sends its
    drafts to every rank with the next step, so all ranks verify the same. Drafts are deterministic
    guesses: the rejection sampler treats each as a point-mass draft distribution.
    """

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.num_speculative_tokens = vllm_config.speculative.num_speculative_tokens

    def load(self, model_runner: Any) -> None:
        """Called once after the target model has loaded (a draft model loads its own weights here)."""

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        """Draft tokens for each row of ``batch`` (an empty list where there is no good guess)."""

    def finished(self, req_ids: list[str]) -> None:
        """Requests that left the batch (finished, aborted or preempted): drop what is kept for them."""
