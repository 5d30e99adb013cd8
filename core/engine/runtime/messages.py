"""Messages across the engine-core boundary (msgspec structs, ready for IPC)."""
from __future__ import annotations

from typing import Optional

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


class EngineCoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    scheduler_stats: Optional[SchedulerStats] = None
