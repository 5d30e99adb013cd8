"""Dynamic speculation: draft only in steps where verifying the drafts is predicted to pay.

A step's time is modelled as ``a + b * tokens + c * sampled positions``, fitted by least squares on the recent
steps of this engine on this machine (a draft is both a token the model computes and a position whose logits
are computed and sampled; the LM head of a large vocabulary makes ``c`` as large as ``b``). With R requests
sampling, a step of T tokens without drafts gives R tokens in ``a + b T + c R``; with D drafts it gives
``R + acceptance * D`` tokens in ``a + b (T + D) + c (R + D)``. Drafts are kept when the second rate beats the
first by ``margin`` (uncertainty costs speculation, not plain decoding). That holds at batch 1, where the
weights' memory traffic (``a``) dominates, and fails for large batches on a compute-bound CPU, or when few
drafts are accepted.
"""

from __future__ import annotations

from collections import deque

import numpy as np

_MIN_SAMPLES = 8
_EXPLORE_EVERY = 64  # steps without drafts before one is tried again (the acceptance may have changed)


class SpeculationPolicy:
    """Step-time model and acceptance estimate of one engine core; ``should_speculate`` decides a step."""

    def __init__(self, enabled: bool = True, window: int = 256, acceptance_decay: float = 0.98, margin: float = 0.05):
        self.enabled = enabled
        self.margin = margin
        self.step_samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.decay = acceptance_decay
        self.drafted = 1.0  # decayed counts, starting from an acceptance estimate of 0.5
        self.accepted = 0.5
        self.steps_without = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted

    def observe_step(self, num_tokens: int, num_sampled_positions: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.step_samples.append((num_tokens, num_sampled_positions, seconds))

    def observe_acceptance(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens:
            self.drafted = self.drafted * self.decay + num_draft_tokens
            self.accepted = self.accepted * self.decay + num_accepted_tokens

    def step_cost(self) -> tuple[float, float, float] | None:
        """(a, b, c) of the fitted step time, or None while there are too few distinct steps to fit."""
        if len(self.step_samples) < _MIN_SAMPLES:
            return None
        tokens, sampled, seconds = np.array(self.step_samples, dtype=np.float64).T
        if np.ptp(tokens) == 0:
            return None
        design = np.stack([np.ones_like(tokens), tokens, sampled], axis=1)
        (a, b, c), _, rank, _ = np.linalg.lstsq(design, seconds, rcond=None)
        if rank < 3 or b < 0 or c < 0:  # the positions do not vary apart from the tokens: one slope for both
            (b, a), c = np.polyfit(tokens, seconds, 1), 0.0
        return max(float(a), 1e-6), max(float(b), 0.0), max(float(c), 0.0)

    def should_speculate(self, num_sampling_requests: int, num_tokens: int, num_draft_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens in which ``num_sampling_requests`` requests sample should
        also verify ``num_draft_tokens`` drafts."""
        if not self.enabled or not num_draft_tokens:
            return True
        cost = self.step_cost()
        if cost is None:
            return True
        a, b, c = cost
        rate_without = num_sampling_requests / (a + b * num_tokens + c * num_sampling_requests)
        rate_with = (num_sampling_requests + self.acceptance_rate * num_draft_tokens) / (
            a + b * (num_tokens + num_draft_tokens) + c * (num_sampling_requests + num_draft_tokens)
        )
        if rate_with > rate_without * (1 + self.margin) or self.steps_without >= _EXPLORE_EVERY:
            self.steps_without = 0
            return True
        self.steps_without += 1
        return False
