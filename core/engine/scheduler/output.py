"""What the scheduler sends to the workers each step, and what comes back."""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from engine.lora_request import LoRARequest
from engine.messages import TokenLogprobs
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct):
    """A request the workers have not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    eos_token_id: Optional[int]
    lora_request: Optional[LoRARequest] = None
    pooling_params: Optional[PoolingParams] = None


class CachedRequestData(msgspec.Struct):
    """A request the workers already hold: only what changed."""

    req_id: str
    new_block_ids: list[list[int]]
    num_computed_tokens: int
    # pipeline parallelism only: the step's input tokens (the stages that do not sample learn tokens here)
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct):
    """One step's plan: which requests run and how many tokens of each."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # finished, aborted or preempted since the last step: workers drop them
    # draft tokens to verify, by request: they follow its known tokens and count in num_scheduled_tokens
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # structured outputs: the constrained requests that sample this step -> their first row of grammar_bitmask,
    # an int32 numpy array [rows, ceil(vocab / 32)] of the tokens each may sample (bit t % 32 of word t // 32);
    # a request with drafts owns 1 + len(drafts) consecutive rows, one per position it samples
    structured_output_request_ids: dict[str, int] = {}
    grammar_bitmask: Optional[Any] = None
    preempted_req_ids: list[str] = []  # preempted by this step's plan (also in finished_req_ids), for the record

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct):
    """Sampled tokens of one step, for the requests that reached the end of their known tokens."""

    req_ids: list[str]
    # empty list for a request still in (chunked) prefill; with drafts, the accepted ones and one more token
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = {}  # per sampled token, for requests asking for logprobs
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}  # prompt positions scored this step
    spec_token_ids: dict[str, list[int]] = {}  # drafts proposed for the next step, by request
    pooler_output: dict[str, list[float]] = {}  # pooling requests that finished their prompt: their result
