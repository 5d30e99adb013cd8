"""Request: the engine core's record of one generation."""

from __future__ import annotations

import enum
import time
from typing import Optional

from engine.kv_cache.hashing import extend_block_hashes
from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # processing this request raised; the engine serves the others

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    """Tokens known so far, how many have KV in the cache, and the prefix hashes of full blocks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int],
        block_size: int,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        resumed_output_token_ids: Optional[list[int]] = None,
        lora_request: Optional[LoRARequest] = None,
        pooling_params: Optional[PoolingParams] = None,
        priority: int = 0,
    ):
        """``resumed_output_token_ids``: tokens this request produced on another engine core (a DP rank that
        died); it starts here as if preempted after them (prompt and these recomputed, sampling goes on)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.pooling_params = pooling_params  # a pooling request: it ends with its prompt (max_tokens 1 holds it)
        self.priority = priority  # scheduler.policy "priority": lower goes first
        self.lora_key = lora_request.prefix_key if lora_request is not None else None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(resumed_output_token_ids or [])
        self.all_token_ids: list[int] = list(prompt_token_ids) + self.output_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling, once known
        self.num_preemptions = 0
        self.num_output_placeholders = 0  # tokens sampled by in-flight steps, not yet known here
        self.num_steps_in_flight = 0  # scheduled steps whose output is not applied yet
        self.stop_reason: Optional[int | str] = None
        self.spec_token_ids: list[int] = []  # drafts proposed after its last step, verified by the next
        self.structured_output_request = None  # its constraint's compile and matcher (StructuredOutputRequest)
        self.block_hashes: list[bytes] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, cache_salt, self.lora_key)

    @property
    def priority_key(self) -> tuple[int, float]:
        """The order of the priority policy: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt, self.lora_key)

    def is_finished(self) -> bool:
        return self.status.finished
