"""vLLM-shaped results: RequestOutput holding one CompletionOutput per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution and its rank (1 = most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One position: {token id: Logprob}, the chosen token first, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error"
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None  # set when a sequence ended with finish_reason "error": what went wrong
