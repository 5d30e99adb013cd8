"""Messages across the engine-core boundary, msgspec-encoded (msgpack) when the core is a process.

Nothing here imports torch: the API-server process decodes these without loading the model stack.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
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
    pooling_output: Optional[list[float]] = None  # a pooling request's result (with finish_reason "stop")


class StepCounters(msgspec.Struct):
    """What the engine core's steps did since start: the live view turns their differences into rates."""

    num_steps: int = 0  # steps that ran a model forward
    step_seconds: float = 0.0  # their time, from plan to applied output
    num_scheduled_requests: int = 0  # the batch sizes added up
    num_prompt_tokens: int = 0  # prompt positions computed (prefill, recomputation included)
    num_generated_tokens: int = 0  # tokens appended to outputs

    @classmethod
    def total(cls, counters: list[StepCounters]) -> StepCounters:
        return cls(
            sum(c.num_steps for c in counters),
            sum(c.step_seconds for c in counters),
            sum(c.num_scheduled_requests for c in counters),
            sum(c.num_prompt_tokens for c in counters),
            sum(c.num_generated_tokens for c in counters),
        )


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
    spec_decoding: Optional[SpecDecodingStats] = None  # None: speculative decoding is off
    num_requests_received: int = 0  # requests this core was given since start
    dp_rank: Optional[int] = 0  # the engine core's DP rank; None in a total over ranks
    per_rank: list[SchedulerStats] = []  # in a total over DP ranks: each rank's own counters
    # MoE models: tokens routed to each expert since start, per MoE layer index (empty for dense models)
    expert_load: dict[int, list[int]] = {}
    steps: StepCounters = msgspec.field(default_factory=StepCounters)

    @classmethod
    def total(cls, per_rank: list[SchedulerStats]) -> SchedulerStats:
        """The counters of all DP ranks added up (KV usage weighted by each rank's blocks), each rank kept."""
        blocks = sum(s.num_total_blocks for s in per_rank)
        spec = [s.spec_decoding for s in per_rank if s.spec_decoding is not None]
        return cls(
            num_running_reqs=sum(s.num_running_reqs for s in per_rank),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in per_rank),
            kv_cache_usage=sum(s.kv_cache_usage * s.num_total_blocks for s in per_rank) / blocks if blocks else 0.0,
            num_free_blocks=sum(s.num_free_blocks for s in per_rank),
            num_total_blocks=blocks,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in per_rank),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in per_rank),
            num_preemptions=sum(s.num_preemptions for s in per_rank),
            spec_decoding=SpecDecodingStats.total(spec) if spec else None,
            num_requests_received=sum(s.num_requests_received for s in per_rank),
            dp_rank=None,
            per_rank=list(per_rank),
            expert_load=_add_expert_load([s.expert_load for s in per_rank]),
            steps=StepCounters.total([s.steps for s in per_rank]),
        )


def _add_expert_load(loads: list[dict[int, list[int]]]) -> dict[int, list[int]]:
    total: dict[int, list[int]] = {}
    for load in loads:
        for layer, counts in load.items():
            before = total.get(layer)
            total[layer] = list(counts) if before is None else [a + b for a, b in zip(before, counts)]
    return total


class SpecDecodingStats(msgspec.Struct):
    """Speculative-decoding counters since start (vLLM's names), and the dynamic-speculation decisions."""

    num_drafts: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []  # index j: drafts accepted at position j
    num_steps_skipped: int = 0  # steps whose drafts dynamic speculation left out

    @classmethod
    def total(cls, stats: list[SpecDecodingStats]) -> SpecDecodingStats:
        width = max(len(s.num_accepted_tokens_per_pos) for s in stats)
        return cls(
            sum(s.num_drafts for s in stats),
            sum(s.num_draft_tokens for s in stats),
            sum(s.num_accepted_tokens for s in stats),
            [
                sum(s.num_accepted_tokens_per_pos[j] for s in stats if j < len(s.num_accepted_tokens_per_pos))
                for j in range(width)
            ],
            sum(s.num_steps_skipped for s in stats),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying request-step: 1 + accepted drafts per draft (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    cache_salt: Optional[str] = None
    # a request migrated from a DP rank that died: the tokens it had already produced there (its client has
    # them). The core takes it as a preempted request: it recomputes prompt + these, and samples on from them
    resumed_output_token_ids: list[int] = []
    lora_request: Optional[LoRARequest] = None  # the adapter this request runs with (None: the base model)
    # a pooling request (embed, classify, score): it ends after its prompt with a pooled output, no token sampled
    pooling_params: Optional[PoolingParams] = None
    priority: int = 0  # scheduler.policy "priority": lower goes first (ignored, and always 0, under fcfs)


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
    engine_index: int = 0  # the DP rank of the core that sent these


class EngineReady(msgspec.Struct):
    """A core's READY message (once loaded): its KV blocks and its pid (a restarted core has a new one)."""

    num_blocks: int
    pid: int


class EngineLoad(msgspec.Struct):
    """What one engine core tells the DP coordinator: its queues, KV usage and prefix-cache summary."""

    dp_rank: int
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    prefix_bits: Optional[bytes] = None  # a PrefixSummary's bits; None: unchanged since the last report
    prefix_num_bits: int = 0


class DPState(msgspec.Struct):
    """What the DP coordinator publishes to every front end: each rank's latest load (None: not heard yet)."""

    loads: list[Optional[EngineLoad]]


class EngineZmqAddresses(msgspec.Struct):
    """Where the engine's processes meet. Front end i binds ``inputs[i]`` (a ROUTER: one DEALER per engine
    core connects, named by its DP rank) and ``outputs[i]`` (a PULL every core pushes to); the DP coordinator
    binds ``coordinator_input`` (cores push their load) and ``coordinator_output`` (front ends subscribe)."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: Optional[str] = None
    coordinator_output: Optional[str] = None


def engine_identity(dp_rank: int) -> bytes:
    """The ZMQ routing id of DP rank ``dp_rank``'s engine core on every front end's ROUTER socket."""
    return b"engine-core-%d" % dp_rank


class EngineCoreRequestType(enum.Enum):
    """First frame of every message to a core process."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    READY = b"\x04"  # core -> front end, once, on the input socket: the core is loaded and routable (EngineReady)


REQUEST_DECODERS: dict[EngineCoreRequestType, msgspec.msgpack.Decoder[Any]] = {
    EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
    EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    EngineCoreRequestType.SHUTDOWN: msgspec.msgpack.Decoder(Any),
}
OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
LOAD_DECODER = msgspec.msgpack.Decoder(EngineLoad)
DP_STATE_DECODER = msgspec.msgpack.Decoder(DPState)
ENCODER = msgspec.msgpack.Encoder()
READY_DECODER = msgspec.msgpack.Decoder(EngineReady)
