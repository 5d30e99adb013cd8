"""InputBatch: the model runner's persistent per-row arrays (as vLLM's ``InputBatch``).

Rows hold the requests of the current step. A request keeps its row from step to step, so a decode
step changes only the rows of requests that entered, left or gained a block; sampled tokens are
appended to all rows in one vectorised write. Removing a request leaves a hole that the next new
request fills, and ``condense`` moves the last rows into the holes that remain, so rows
``0..num_reqs-1`` are always the batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, cast

import numpy as np

from engine.interfaces.logits_processor import SAMPLING_COLUMNS
from engine.sampling_params import SamplingParams
from engine.worker.block_table import BlockTable

_INITIAL_TOKEN_WIDTH = 1024


@dataclass(frozen=True)
class BatchFacts:
    """What the batch's rows ask of a step beyond sampling, found once per change of the rows' requests
    (``InputBatch.facts``) instead of by a scan of the rows every step."""

    any_logprobs: bool  # some row wants the logprobs of its sampled tokens
    any_prompt_logprobs: bool  # some row scores its prompt
    any_processor: bool  # some row asked for a logits processor
    any_seeded: bool  # some row samples from its own seed


@dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps (its tokens live in the batch while it has a row)."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt followed by outputs; current only while the request has no row
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per group; current only while the request has no row
    num_computed_tokens: int
    eos_token_id: Optional[int]
    processor_mask: list[bool] = field(default_factory=list)  # which logits processors it asked for
    lora_int_id: int = 0  # its LoRA adapter's id (0: the base model)


class InputBatch:
    """Token ids, block tables, computed-token counts and sampling settings of every row."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_sizes: list[int], num_processors: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[Optional[str]] = []  # row -> request id; None marks a hole until condense
        self.req_id_to_index: dict[str, int] = {}
        self._holes: list[int] = []  # a heap of free rows below len(req_ids)
        self.params: list[Optional[SamplingParams]] = [None] * max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, min(max_model_len + 1, _INITIAL_TOKEN_WIDTH)), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.eos_token_id = np.full(max_num_reqs, -1, dtype=np.int64)
        self._columns = {name: np.zeros(max_num_reqs, dtype=dtype) for name, dtype in SAMPLING_COLUMNS.items()}
        self.seeds = np.zeros(max_num_reqs, dtype=np.int64)
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: the request wants none
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.uses_processor = np.zeros((num_processors, max_num_reqs), dtype=bool)
        self.lora_int_id = np.zeros(max_num_reqs, dtype=np.int64)  # each row's adapter id (0: the base model)
        max_blocks = [-(-max_model_len // size) for size in block_sizes]
        self.block_tables = [BlockTable(max_num_reqs, blocks, size) for blocks, size in zip(max_blocks, block_sizes)]
        self._facts: Optional[BatchFacts] = None  # dropped whenever a row's request enters, leaves or moves

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def sampling_column(self, name: str) -> np.ndarray:
        return self._columns[name]

    def facts(self) -> BatchFacts:
        """The rows' ``BatchFacts``: the same object from step to step while no request enters, leaves or moves (a
        steady decode batch), so what is derived from the rows' settings alone can be kept with it."""
        if self._facts is None:
            rows = slice(0, len(self.req_ids))  # holes included: their settings are a removed request's or defaults
            self._facts = BatchFacts(
                any_logprobs=bool((self.num_logprobs[rows] >= 0).any()),
                any_prompt_logprobs=bool((self.num_prompt_logprobs[rows] >= 0).any()),
                any_processor=bool(self.uses_processor[:, rows].any()),
                any_seeded=bool(self.seeded[rows].any()),
            )
        return self._facts

    # ---- rows in and out ----------------------------------------------------------------------
    def add_request(self, state: CachedRequestState) -> int:
        if self._holes:
            row = heapq.heappop(self._holes)
            self.req_ids[row] = state.req_id
        else:
            row = len(self.req_ids)
            if row >= self.max_num_reqs:
                raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows = scheduler.max_num_seqs)")
            self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        self._facts = None
        params = state.sampling_params
        self.params[row] = params
        self._ensure_width(len(state.token_ids) + 1)
        self.token_ids[row, : len(state.token_ids)] = state.token_ids
        self.num_tokens[row] = len(state.token_ids)
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.eos_token_id[row] = -1 if state.eos_token_id is None else state.eos_token_id
        for name, column in self._columns.items():
            column[row] = getattr(params, name)
        self.seeded[row] = params.seed is not None and not params.greedy
        self.seeds[row] = params.seed if self.seeded[row] and params.seed is not None else 0
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.uses_processor[:, row] = state.processor_mask
        self.lora_int_id[row] = state.lora_int_id
        for table, ids in zip(self.block_tables, state.block_ids):
            table.add_row(ids, row)
        return row

    def remove_request(self, req_id: str, state: Optional[CachedRequestState] = None) -> None:
        """Free the request's row; with ``state``, first copy its tokens and blocks back into it."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self._facts = None
        if state is not None:
            state.token_ids = self.token_ids[row, : self.num_tokens[row]].tolist()
            state.block_ids = [table.row_ids(row) for table in self.block_tables]
            state.num_computed_tokens = int(self.num_computed_tokens[row])
        self.req_ids[row] = None
        self.params[row] = None
        heapq.heappush(self._holes, row)

    def condense(self) -> None:
        """Move the last rows into the holes so that rows ``0..num_reqs-1`` hold the batch."""
        while self._holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
            hole = heapq.heappop(self._holes)
            if hole >= len(self.req_ids):
                continue
            last = len(self.req_ids) - 1
            self._move_row(last, hole)
            self.req_ids.pop()
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()

    def _move_row(self, src: int, dst: int) -> None:
        req_id = cast(str, self.req_ids[src])  # a filled row moves into a hole
        self._facts = None
        self.req_ids[dst] = req_id
        self.req_id_to_index[req_id] = dst
        self.params[dst], self.params[src] = self.params[src], None
        self.token_ids[dst, : self.num_tokens[src]] = self.token_ids[src, : self.num_tokens[src]]
        for array in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.eos_token_id,
            self.seeds,
            self.seeded,
            self.num_logprobs,
            self.num_prompt_logprobs,
            self.lora_int_id,
            *self._columns.values(),
        ):
            array[dst] = array[src]
        self.uses_processor[:, dst] = self.uses_processor[:, src]
        for table in self.block_tables:
            table.move_row(src, dst)

    # ---- per-step updates --------------------------------------------------------------------
    def append_block_ids(self, row: int, new_block_ids: list[list[int]]) -> None:
        for table, ids in zip(self.block_tables, new_block_ids):
            table.append_row(ids, row)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        if not len(rows):
            return
        ends = self.num_tokens[rows]
        self._ensure_width(int(ends.max()) + 1)
        self.token_ids[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1

    def write_drafts(self, row: int, draft_token_ids: list[int]) -> None:
        """Place draft tokens right after the row's known tokens (they are inputs of this step, not known
        tokens: ``num_tokens`` does not move)."""
        end = int(self.num_tokens[row])
        self._ensure_width(end + len(draft_token_ids) + 1)
        self.token_ids[row, end : end + len(draft_token_ids)] = draft_token_ids

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Append several tokens to one row (the accepted drafts and the token after them)."""
        end = int(self.num_tokens[row])
        self._ensure_width(end + len(token_ids) + 1)
        self.token_ids[row, end : end + len(token_ids)] = token_ids
        self.num_tokens[row] = end + len(token_ids)

    def _ensure_width(self, width: int) -> None:
        if width <= self.token_ids.shape[1]:
            return
        new_width = min(max(width, 2 * self.token_ids.shape[1]), self.max_model_len + 1)
        grown = np.zeros((self.max_num_reqs, new_width), dtype=np.int32)
        grown[:, : self.token_ids.shape[1]] = self.token_ids
        self.token_ids = grown
