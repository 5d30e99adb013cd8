"""PoolingParams: what a pooling request asks of a pooling model (vLLM's names): the task, and for embeddings
the Matryoshka dimensions and normalisation, for classification whether the activation is applied."""

from __future__ import annotations

from typing import Literal, Optional

import msgspec

from engine.errors import InvalidParameterError

PoolingTask = Literal["embed", "classify", "score", "encode"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``task``: ``embed`` (a vector per prompt), ``classify`` (class probabilities), ``score`` (one relevance
    score of a query-document pair, from a cross-encoder) or ``encode`` (the pooled hidden state, no head).

    ``dimensions``: keep the first ``dimensions`` values of an embedding (Matryoshka models), before
    normalisation. ``normalize``: L2-normalise an embedding (None: the model's default). ``activation``: apply
    sigmoid (one label) or softmax (several) to a classifier's logits (None: yes)."""

    task: str = "embed"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    activation: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidParameterError(
                f"PoolingParams.task must be one of {list(POOLING_TASKS)}, got {self.task!r}", "task"
            )
        if self.dimensions is not None:
            if self.task != "embed":
                raise InvalidParameterError("dimensions applies to embeddings only (task 'embed')", "dimensions")
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise InvalidParameterError(
                    f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions"
                )

    def validate_for_model(
        self, tasks: tuple[str, ...], embedding_size: int, matryoshka: Optional[list[int]] | bool
    ) -> None:
        """InvalidParameterError unless the model serves this task (and these dimensions). ``matryoshka``: False for
        a model not trained for truncated embeddings, True for one trained for any size, else the sizes it was."""
        if self.task not in tasks:
            raise InvalidParameterError(
                f"this model serves the pooling tasks {list(tasks)}; task {self.task!r} is not one of them", "task"
            )
        if self.dimensions is None:
            return
        if matryoshka is False:
            raise InvalidParameterError(
                "this model does not support Matryoshka representation: dimensions cannot be set", "dimensions"
            )
        if self.dimensions > embedding_size:
            raise InvalidParameterError(
                f"dimensions={self.dimensions} exceeds the model's embedding size ({embedding_size})", "dimensions"
            )
        if isinstance(matryoshka, list) and self.dimensions not in matryoshka:
            raise InvalidParameterError(
                f"dimensions={self.dimensions} is not one of the sizes this model was trained for: {matryoshka}",
                "dimensions",
            )
