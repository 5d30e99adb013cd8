"""LogitsProcessor interface: acts on the rows of the requests that ask for it."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, cast

import numpy as np
import torch

from engine.interfaces.base import Pluggable

__all__ = ["SAMPLING_COLUMNS", "BatchRows", "LogitsBatch", "LogitsProcessor", "LogitsRequestView"]

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.sampling_params import SamplingParams

# the per-row sampling settings a processor can read as a column, and their dtypes
SAMPLING_COLUMNS = {
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int64,
    "min_p": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "repetition_penalty": np.float32,
}


@dataclass
class LogitsRequestView:
    """Contract 1.2: what a logits processor could read about one request (kept for 1.2 plugins, see ``legacy``)."""

    params: object  # SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: Optional[int]


class BatchRows(Protocol):
    """What a ``LogitsBatch`` reads: per-row arrays indexed by batch row (the runner's persistent input batch
    provides them without a copy)."""

    @property
    def req_ids(self) -> Sequence[Optional[str]]: ...  # None: a free row (never one a LogitsBatch reads)

    @property
    def params(self) -> Sequence[Optional[SamplingParams]]: ...

    num_prompt_tokens: np.ndarray  # [rows] int
    num_tokens: np.ndarray  # [rows] int: prompt and output tokens known so far
    token_ids: np.ndarray  # [rows, width] int: prompt then output tokens
    eos_token_id: np.ndarray  # [rows] int, -1 where none

    def sampling_column(self, name: str) -> np.ndarray:
        """[rows] the setting ``name`` of ``SAMPLING_COLUMNS`` for each row."""
        ...


class RequestRows:
    """``BatchRows`` of a few requests, built from their lists (``LogitsBatch.from_requests``)."""

    def __init__(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_id: Optional[int] = None,
    ):
        tokens = [list(p) + list(o) for p, o in zip(prompt_token_ids, output_token_ids)]
        self.req_ids = [f"req-{i}" for i in range(len(params))]
        self.params = list(params)
        self.num_prompt_tokens = np.array([len(p) for p in prompt_token_ids], dtype=np.int64)
        self.num_tokens = np.array([len(t) for t in tokens], dtype=np.int64)
        self.token_ids = np.zeros((len(tokens), max(map(len, tokens), default=0) + 1), dtype=np.int64)
        for row, ids in enumerate(tokens):
            self.token_ids[row, : len(ids)] = ids
        self.eos_token_id = np.full(len(params), -1 if eos_token_id is None else eos_token_id, dtype=np.int64)
        self._columns = {
            name: np.array([getattr(p, name) for p in params], dtype=dtype) for name, dtype in SAMPLING_COLUMNS.items()
        }

    def sampling_column(self, name: str) -> np.ndarray:
        return self._columns[name]


class LogitsBatch:
    """The rows of one step that asked for a processor, read from the runner's persistent input batch.

    Contract 1.3. ``rows[i]`` is the logits row of request ``req_ids[i]``; every other attribute is
    indexed by ``i``. Tensors are built on first access, so a processor pays only for what it reads.

    With speculative decoding a request has one logits row per verified position: position j of a request
    with drafts sees its known tokens followed by its first j drafts (``num_tokens`` grows by j), so a
    processor that reads tokens through this view acts on every position as plain decoding would.
    """

    def __init__(
        self, rows: torch.Tensor, batch: BatchRows, batch_rows: np.ndarray, num_tokens: np.ndarray | None = None
    ):
        self.rows = rows
        self._batch = batch
        self._batch_rows = batch_rows
        self._num_tokens = batch.num_tokens[batch_rows] if num_tokens is None else num_tokens

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_id: int | None = None,
    ) -> LogitsBatch:
        """A batch of the given requests on rows 0..n-1 of the logits, outside any engine (for unit tests)."""
        rows = RequestRows(params, prompt_token_ids, output_token_ids, eos_token_id)
        return cls(torch.arange(len(params)), rows, np.arange(len(params)))

    def __len__(self) -> int:
        return len(self._batch_rows)

    @cached_property
    def req_ids(self) -> list[str]:
        return [cast(str, self._batch.req_ids[r]) for r in self._batch_rows]

    @cached_property
    def params(self) -> list[SamplingParams]:
        return [cast("SamplingParams", self._batch.params[r]) for r in self._batch_rows]

    @cached_property
    def num_prompt_tokens(self) -> torch.Tensor:
        """[n] int64."""
        return torch.from_numpy(self._batch.num_prompt_tokens[self._batch_rows])

    @cached_property
    def num_tokens(self) -> torch.Tensor:
        """[n] int64: prompt and output tokens known so far."""
        return torch.from_numpy(self._num_tokens)

    @property
    def num_output_tokens(self) -> torch.Tensor:
        return self.num_tokens - self.num_prompt_tokens

    @cached_property
    def token_ids(self) -> torch.Tensor:
        """[n, L] int64: each row's prompt then output tokens, zero past ``num_tokens`` (L: the longest)."""
        width = int(self.num_tokens.max()) if len(self) else 0
        ids = self._batch.token_ids[self._batch_rows, :width].astype(np.int64)
        ids[np.arange(width)[None, :] >= self._num_tokens[:, None]] = 0  # the batch keeps drafts past a row's end
        return torch.from_numpy(ids)

    def output_tail(self, i: int, length: int) -> list[int]:
        """The last ``length`` output tokens of row ``i`` (fewer when it has produced fewer)."""
        row = self._batch_rows[i]
        end = int(self._num_tokens[i])
        start = max(int(self._batch.num_prompt_tokens[row]), end - length)
        return [int(t) for t in self._batch.token_ids[row, start:end]]

    @cached_property
    def eos_token_ids(self) -> torch.Tensor:
        """[n] int64, -1 where the request has none."""
        return torch.from_numpy(self._batch.eos_token_id[self._batch_rows])

    def column(self, name: str) -> torch.Tensor:
        """[n] float32 sampling setting of each row: temperature, top_p, min_p, presence_penalty,
        frequency_penalty, repetition_penalty (int64: top_k)."""
        return torch.from_numpy(self._batch.sampling_column(name)[self._batch_rows])


class LogitsProcessor(Pluggable):
    """Changes logits in place for a batch of rows, all belonging to requests that asked for it.

    Constructed once per worker as ``cls(vllm_config)``. ``requested_by`` is asked once per request, when
    it enters the worker's batch; ``apply`` runs every step that samples any of those requests.
    """

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config

    @classmethod
    @abstractmethod
    def requested_by(cls, params: SamplingParams) -> bool:
        """Whether a request with these SamplingParams uses this processor."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> None:
        """Modify ``logits[batch.rows]`` in place."""
