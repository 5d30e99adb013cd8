"""The V1 scheduler: no prefill/decode phases, only 'how many tokens of each request this step'."""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

import msgspec

from engine.config import VllmConfig
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import KVCacheConfig
from engine.messages import EngineCoreOutput, SchedulerStats, SpecDecodingStats, StepCounters
from engine.scheduler.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.scheduler.request import Request, RequestStatus
from engine.spec_decode.dynamic import SpeculationPolicy

if TYPE_CHECKING:
    from engine.interfaces.structured_output import StructuredOutputGrammar

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    target: Optional[str] = None  # while requests are isolated: the one request this step may run
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    forced: Optional[tuple[dict[str, int], dict[str, list[int]]]] = None  # engine replay: the recorded step


class Scheduler:
    """Continuous batching within a token budget; preemption by recompute when blocks run out."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        coordinator_cls: type,
        max_model_len: int,
        structured_output_manager=None,
    ):
        sched = vllm_config.scheduler
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_num_seqs = sched.max_num_seqs
        self.max_loras = vllm_config.lora.max_loras if vllm_config.lora.enable_lora else 0
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.async_scheduling = sched.async_scheduling
        self.priority_policy = sched.policy == "priority"  # else fcfs
        # stages before the last do not sample: each step tells them its input tokens
        self.send_token_ids = vllm_config.parallel.pipeline_parallel_size > 1
        self.max_model_len = max_model_len
        self.dp_rank = vllm_config.parallel.data_parallel_rank
        self.block_size = kv_cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, coordinator_cls, max_model_len, vllm_config.cache.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_requests_received = 0
        self.step_counters = StepCounters()  # the engine core adds each step's time
        # requests of a step that failed: run one at a time until each has sampled, to find the culprit
        self.isolated: dict[str, None] = {}
        self.structured_output_manager = structured_output_manager
        self.error_outputs: list[EngineCoreOutput] = []  # requests that failed outside a step, to report
        speculative = vllm_config.speculative
        self.use_spec_decode = speculative.method != "none"
        self.spec_stats = SpecDecodingStats() if self.use_spec_decode else None
        self.spec_policy = SpeculationPolicy(speculative.dynamic_speculation) if self.use_spec_decode else None
        self._step_started: Optional[float] = None
        # engine replay: the next step's recorded plan (tokens per request, drafts), consumed by schedule()
        self.forced_step: Optional[tuple[dict[str, int], dict[str, list[int]]]] = None
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than the "
                f"context length ({max_model_len}) with scheduler.enable_chunked_prefill=false: long prompts "
                "could never be scheduled; raise the budget, lower model.max_model_len or enable chunked prefill"
            )

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; a constrained one starts its grammar's compile (ConfigError: no backend here)."""
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError("this scheduler has no structured-output manager")
            request.structured_output_request = self.structured_output_manager.request(
                constraint, resumed_token_ids=request.output_token_ids
            )
        self.requests[request.request_id] = request
        self._enqueue_waiting(request, front=False)
        self.num_requests_received += 1

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        """Queue a request to wait: under fcfs at the back (``front``: a preempted one, at the front); under the
        priority policy at its place by (priority, arrival)."""
        if self.priority_policy:
            place = bisect.bisect_right(self.waiting, request.priority_key, key=lambda r: r.priority_key)
            self.waiting.insert(place, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (abort) requests from outside; their blocks return to the pool."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[EngineCoreOutput]:
        """Finish requests whose processing raised; their blocks return to the pool."""
        request_ids = [rid for rid in request_ids if rid in self.requests]
        self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        return [
            EngineCoreOutput(rid, [], RequestStatus.FINISHED_ERROR.finish_reason, error=error) for rid in request_ids
        ]

    def isolate(self, request_ids: Iterable[str]) -> None:
        """Roll back the requests of a failed step (preempt: their KV is recomputed) and schedule them one at
        a time, alone in their steps, until each has sampled a token: the next failure names its request."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
                self.finished_req_ids.add(request_id)  # the workers drop its state until it is rescheduled
            self.isolated[request_id] = None

    def _isolated_target(self) -> Optional[str]:
        """The one request a step may run while requests are isolated (None: none are); it goes first."""
        for request_id in self.isolated:
            request = self.requests[request_id]
            if request.status != RequestStatus.RUNNING and self.waiting[0] is not request:
                self.waiting.remove(request)
                self.waiting.appendleft(request)
            return request_id
        return None

    def _free_request(self, request: Request) -> None:
        self.isolated.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step in three stages: the running requests first (decode tokens, drafts, prefill chunks,
        preempting the latest admitted when blocks run out), then waiting ones while the budget lasts (none
        after a preemption), then the plan is finished into the ``SchedulerOutput`` the workers run."""
        forced, self.forced_step = self.forced_step, None
        if forced is not None:  # a replayed step: the recorded requests, each with its recorded tokens and drafts
            plan = StepPlan(sum(forced[0].values()), forced=forced)
            self._schedule_running(plan, use_drafts=True)
            self._schedule_waiting(plan)
            return self._finish_plan(plan)
        plan = StepPlan(self.max_num_batched_tokens, target=self._isolated_target())
        self._schedule_running(plan, use_drafts=self.use_spec_decode and self._drafts_pay())
        if not plan.preempted:  # a step that had to preempt admits nobody new
            self._schedule_waiting(plan)
        return self._finish_plan(plan)

    def _schedule_running(self, plan: StepPlan, use_drafts: bool) -> None:
        """Give each running request (the isolated one alone, while requests are isolated) its next tokens."""
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            req_index += 1
            if plan.target is not None and request.request_id != plan.target:
                continue
            if request.structured_output_request is not None and request.num_steps_in_flight:
                continue  # its matcher has not seen the token in flight: the next bitmask must wait for it
            if plan.forced is not None and request.request_id not in plan.forced[0]:
                continue
            num_known = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            if plan.forced is not None:
                request.spec_token_ids = list(plan.forced[1].get(request.request_id, ()))
            drafts = self._drafts_to_verify(request) if use_drafts else []
            num_new = min(num_known + len(drafts), plan.token_budget, self.max_model_len - request.num_computed_tokens)
            if plan.forced is not None:
                num_new = min(num_new, plan.forced[0][request.request_id])
            else:
                num_new = self.kv_cache_manager.align_num_new_tokens(request, request.num_computed_tokens, num_new)
            if num_new <= 0 or self._reached_max_tokens(request):
                continue  # nothing to compute, or in-flight steps already produce its last token
            drafts = drafts[: max(0, num_new - num_known)]
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self._pick_victim()
                if self.running.index(victim) < req_index:
                    req_index -= 1  # planned earlier in this loop (priority policy): its plan is undone
                self._preempt_planned(plan, victim)
                if victim is request:
                    return
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            plan.num_scheduled[request.request_id] = num_new
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            plan.token_budget -= num_new
            start = request.num_computed_tokens
            plan.cached_reqs.append(
                CachedRequestData(
                    request.request_id,
                    new_blocks.get_block_ids(),
                    start,
                    request.all_token_ids[start : start + num_new] if self.send_token_ids else [],
                )
            )

    def _drafts_to_verify(self, request: Request) -> list[int]:
        """The request's drafts this step can verify: each needs a position within the context and within
        max_tokens (after all are accepted one more token follows), and its grammar must allow it."""
        drafts = request.spec_token_ids[: max(0, self.max_model_len - request.num_tokens - 1)]
        max_tokens = request.sampling_params.max_tokens
        if drafts and max_tokens is not None:
            drafts = drafts[: max(0, max_tokens - request.num_output_tokens - 1)]
        constraint = request.structured_output_request
        if drafts and constraint is not None and constraint.grammar is not None:
            drafts = constraint.grammar.validate_tokens(drafts)  # a refused draft, and those after it, never count
        return drafts

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in order while the budget, the batch size and the blocks allow; requests whose
        grammar still compiles are stepped over (the requests behind them go first) and keep their place."""
        skipped: list[Request] = []
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if plan.target is not None and (request.request_id != plan.target or plan.num_scheduled):
                break
            if plan.forced is not None and request.request_id not in plan.forced[0]:
                skipped.append(self.waiting.popleft())  # not admitted in this recorded step
                continue
            if request.num_steps_in_flight:
                break  # preempted while a step of it runs: readmitted once that step's token is known
            if request.lora_request is not None and self._adapter_slots_full(request.lora_request.lora_int_id):
                skipped.append(self.waiting.popleft())  # waits for a running adapter to finish; others go first
                continue
            constraint = request.structured_output_request
            if constraint is not None and not constraint.is_ready():
                skipped.append(self.waiting.popleft())
                continue
            if constraint is not None and constraint.error is not None:
                self.waiting.popleft()
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request)
                self.error_outputs.append(EngineCoreOutput(request.request_id, [], "error", error=constraint.error))
                continue
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.enable_chunked_prefill and num_new > plan.token_budget:
                break
            num_new = min(num_new, plan.token_budget)
            if plan.forced is not None:
                num_new = min(num_new, plan.forced[0][request.request_id])
            else:
                num_new = self.kv_cache_manager.align_num_new_tokens(request, num_hit, num_new)
            if self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                if not self._preempt_for(plan, request):
                    break
                continue  # blocks were freed: plan this request again (its prefix hits may have changed)
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            plan.num_scheduled[request.request_id] = num_new
            plan.token_budget -= num_new
            plan.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    eos_token_id=request.eos_token_id,
                    lora_request=request.lora_request,
                    pooling_params=request.pooling_params,
                )
            )
        self.waiting.extendleft(reversed(skipped))

    def _adapter_slots_full(self, lora_int_id: int) -> bool:
        """Whether admitting a request of adapter ``lora_int_id`` would make the running requests use more than
        ``lora.max_loras`` distinct adapters (a step's adapters must fit the workers' slots)."""
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora_int_id not in running and len(running) >= self.max_loras

    def _finish_plan(self, plan: StepPlan) -> SchedulerOutput:
        """The step's SchedulerOutput; the scheduled requests advance (their tokens count as computed, a step of
        each is in flight) and constrained ones get their bitmask rows."""
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=sorted(self.finished_req_ids | {r.request_id for r in plan.preempted}),
            scheduled_spec_decode_tokens=plan.spec_tokens,
            preempted_req_ids=[r.request_id for r in plan.preempted],
        )
        self.finished_req_ids = set()
        if self.use_spec_decode:
            for request in self.running:  # drafts are for the step right after the one that proposed them
                request.spec_token_ids = []
        counters = self.step_counters
        for req_id, num in plan.num_scheduled.items():
            request = self.requests[req_id]
            start, num_prompt = request.num_computed_tokens, len(request.prompt_token_ids)
            counters.num_prompt_tokens += max(0, min(start + num, num_prompt) - start)
            request.num_computed_tokens += num
            request.num_steps_in_flight += 1
            if (
                self.async_scheduling
                and request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # this step samples a token we will only see later
        if self.structured_output_manager is not None:
            self._add_grammar_bitmask(output)
        if self.use_spec_decode:
            self._step_started = time.perf_counter()  # the step's time feeds dynamic speculation's cost model
        return output

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The allowed-token bitmask of every constrained request that samples in this step: its first row, then
        one more per speculative draft (the runner masks the logits row of draft position i with row first + i)."""
        first_rows: dict[str, int] = {}
        rows: list[tuple[Any, list[int]]] = []  # (grammar, drafts) of each constrained request that samples
        num_rows = 0
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            constraint = request.structured_output_request
            if constraint is None or constraint.grammar is None or request.num_computed_tokens < request.num_tokens:
                continue  # unconstrained, or a prefill chunk that samples nothing
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            first_rows[req_id] = num_rows
            rows.append((constraint.grammar, drafts))
            num_rows += 1 + len(drafts)
        if rows:
            output.structured_output_request_ids = first_rows
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(rows)

    def num_waiting_for_grammar(self) -> int:
        """Waiting requests whose constraint is still compiling."""
        return sum(
            1
            for request in self.waiting
            if request.structured_output_request is not None and not request.structured_output_request.is_ready()
        )

    def _drafts_pay(self) -> bool:
        """Dynamic speculation: whether this step should verify the running requests' drafts."""
        num_drafts = sum(len(request.spec_token_ids) for request in self.running)
        if not num_drafts:
            return True
        num_sampling = sum(1 for request in self.running if request.num_computed_tokens >= request.num_tokens - 1)
        num_tokens = sum(
            min(request.num_tokens - request.num_computed_tokens, self.max_num_batched_tokens)
            for request in self.running
        )
        assert self.spec_policy is not None and self.spec_stats is not None  # called with speculation on only
        if self.spec_policy.should_speculate(num_sampling, num_tokens, num_drafts):
            return True
        self.spec_stats.num_steps_skipped += 1
        return False

    def _reached_max_tokens(self, request: Request) -> bool:
        produced = request.num_output_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and produced >= max_tokens) or (
            request.num_tokens + request.num_output_placeholders >= self.max_model_len
        )

    def _pick_victim(self) -> Request:
        """The running request to preempt when blocks run out: under fcfs the latest admitted; under the priority
        policy the lowest priority (highest value), the latest arrival among equals (vLLM's rule)."""
        if self.priority_policy:
            return max(self.running, key=lambda r: r.priority_key)
        return self.running[-1]

    def _preempt_for(self, plan: StepPlan, request: Request) -> bool:
        """Priority policy: free blocks for waiting ``request`` by preempting the running request of lowest
        priority, if it ranks below ``request`` and was not admitted in this step; its planned tokens go back to
        the budget. Whether one was preempted (fcfs never preempts for a waiting request)."""
        if not self.priority_policy:
            return False
        admitted = {new.req_id for new in plan.new_reqs}
        candidates = [r for r in self.running if r.request_id not in admitted and r.priority_key > request.priority_key]
        if not candidates:
            return False
        self._preempt_planned(plan, max(candidates, key=lambda r: r.priority_key))
        return True

    def _preempt_planned(self, plan: StepPlan, victim: Request) -> None:
        """Preempt running ``victim``; if this step had planned tokens for it, they go back to the budget."""
        num_planned = plan.num_scheduled.pop(victim.request_id, 0)
        if num_planned:
            plan.token_budget += num_planned
            plan.cached_reqs = [c for c in plan.cached_reqs if c.req_id != victim.request_id]
            plan.spec_tokens.pop(victim.request_id, None)
        self.running.remove(victim)
        self._preempt(victim)
        plan.preempted.append(victim)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(request, front=True)
        logger.debug("preempted %s (recompute later)", request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free what finished."""
        if self._step_started is not None and self.spec_policy is not None:  # timed with speculation on only
            num_sampled = sum(1 for tokens in runner_output.sampled_token_ids if tokens) + sum(
                len(drafts) for drafts in scheduler_output.scheduled_spec_decode_tokens.values()
            )
            self.spec_policy.observe_step(
                scheduler_output.total_num_scheduled_tokens, num_sampled, time.perf_counter() - self._step_started
            )
            self._step_started = None
        self.step_done(scheduler_output)
        outputs = []
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            pooled = runner_output.pooler_output.get(req_id)
            if pooled is not None:
                if request is not None:
                    outputs.append(self._finish_pooling(request, pooled))
                continue
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if request is None or not (token_ids or prompt_logprobs):
                continue  # aborted meanwhile, or a prefill chunk that samples nothing
            if token_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if token_ids and self.isolated:
                self.isolated.pop(req_id, None)  # it ran through the sampler alone: not the culprit
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and token_ids and self.spec_stats is not None and self.spec_policy is not None:
                num_accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted  # rejected drafts' KV is recomputed
                self.spec_stats.observe(len(drafts), num_accepted)
                self.spec_policy.observe_acceptance(len(drafts), num_accepted)
            new_token_ids = []
            error = None
            constraint = request.structured_output_request
            for token_id in token_ids:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if constraint is not None and constraint.grammar is not None:
                    error = self._advance_grammar(request, constraint.grammar, token_id)
                    if request.is_finished():
                        break
                if self._check_stop(request):
                    break
            self.step_counters.num_generated_tokens += len(new_token_ids)
            if request.is_finished():
                # a request preempted while its step was in flight sits in the waiting queue
                (self.running if request in self.running else self.waiting).remove(request)
                self._free_request(request)
            elif request.status == RequestStatus.RUNNING:
                request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    request.status.finish_reason,
                    request.stop_reason,
                    max(request.num_cached_tokens, 0),
                    logprobs[: len(new_token_ids)] if logprobs else None,
                    prompt_logprobs,
                    error=error,
                )
            )
        return outputs

    def _finish_pooling(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """A pooling request has run its whole prompt: it ends here, its blocks back in the pool."""
        request.num_output_placeholders = 0
        request.status = RequestStatus.FINISHED_STOPPED
        (self.running if request in self.running else self.waiting).remove(request)
        self._free_request(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            request.status.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            pooling_output=pooled,
        )

    @staticmethod
    def _advance_grammar(request: Request, grammar: StructuredOutputGrammar, token_id: int) -> Optional[str]:
        """Feed a sampled token to the request's matcher: a grammar that has ended stops the request; a token the
        grammar refuses (a logits processor forced it past the bitmask) ends it with an error."""
        if not grammar.accept_tokens([token_id]):
            request.status = RequestStatus.FINISHED_ERROR
            logger.error("request %s sampled token %d, which its grammar does not allow", request.request_id, token_id)
            return (
                f"the sampled token {token_id} breaks the request's structured-output constraint (another "
                "setting, such as min_tokens or logit_bias, forced a token the grammar does not allow)"
            )
        if grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
        return None

    def record_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Count a step whose output was applied: its time (from plan to applied output) and its batch size."""
        if not scheduler_output.is_empty:
            self.step_counters.num_steps += 1
            self.step_counters.step_seconds += seconds
            self.step_counters.num_scheduled_requests += len(scheduler_output.num_scheduled_tokens)

    def step_done(self, scheduler_output: SchedulerOutput) -> None:
        """A scheduled step has ended (its output applied, or the step failed)."""
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None:
                request.num_steps_in_flight -= 1

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return False

    def make_stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        stats = manager.prefix_cache_stats
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            manager.usage,
            manager.num_free_blocks,
            manager.num_total_blocks,
            stats.queries,
            stats.hits,
            self.num_preemptions,
            msgspec.structs.replace(
                self.spec_stats, num_accepted_tokens_per_pos=list(self.spec_stats.num_accepted_tokens_per_pos)
            )
            if self.spec_stats
            else None,
            self.num_requests_received,
            self.dp_rank,
            steps=msgspec.structs.replace(self.step_counters),
        )
