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
    pooling_output: Optional[list[float]] = None  # a pooling request's result, once finished


@dataclass
class PoolingOutput:
    """A pooling request's result: the embedding, the class probabilities or the score, as a list."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode`` / ``AsyncLLM.encode`` return for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    error: Optional[str] = None

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> PoolingRequestOutput:
        return cls(
            output.request_id,
            output.prompt_token_ids,
            PoolingOutput(list(output.pooling_output or [])),
            output.finished,
            output.error,
        )


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.outputs.data), output.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(
            output.request_id, output.prompt_token_ids, ClassificationOutput(output.outputs.data), output.finished
        )


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
