"""Messages across the engine-core boundary, msgspec-encoded (msgpack) when the core is a process."""
from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from engine.sampling_params import SamplingParams
from engine.scheduler.scheduler import EngineCoreOutput, SchedulerStats


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
