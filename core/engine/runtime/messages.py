"""Messages across the engine-core boundary, msgspec-encoded (msgpack) when the core is a process.

Nothing here imports torch: the API-server process decodes these without loading the model stack.
"""
from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from engine.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position: the chosen token first, then the top-k; rank is the chosen token's (1 = best)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct):
    """New tokens of one request after a step, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0
    new_logprobs: Optional[list[TokenLogprobs]] = None
    new_prompt_logprobs: Optional[list[TokenLogprobs]] = None
    error: Optional[str] = None  # with finish_reason "error": why this request failed


class SchedulerStats(msgspec.Struct):
    """Counters for logs, metrics and tests."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    cache_salt: Optional[str] = None


class UtilityCall(msgspec.Struct):
    """Call ``EngineCore.<method>(*args)`` and send the result back tagged with ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityOutput(msgspec.Struct):
    call_id: int
    result: Any = None
    error: Optional[str] = None


class EngineCoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    scheduler_stats: Optional[SchedulerStats] = None
    utility_output: Optional[UtilityOutput] = None
    engine_error: Optional[str] = None  # set once, by a core that is going down


class EngineCoreRequestType(enum.Enum):
    """First frame of every message to a core process."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


READY_CALL_ID = -1  # the utility output a core process sends once it can take requests
REQUEST_DECODERS = {
    EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
    EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    EngineCoreRequestType.SHUTDOWN: msgspec.msgpack.Decoder(Any),
}
OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
ENCODER = msgspec.msgpack.Encoder()
