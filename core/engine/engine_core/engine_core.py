"""EngineCore: the busy loop's body. Schedule, execute through the executor, update, report."""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

from engine.config import ConfigError, VllmConfig
from engine.engine_core.flight_recorder import FlightRecorder, recording_header
from engine.errors import EngineDeadError
from engine.hookspecs import KINDS
from engine.interfaces.base import SelectionContext
from engine.kv_cache.spec import make_kv_cache_config
from engine.lifetime import freeze_gc_heap, release_gc_heap
from engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from engine.model.loader import get_model_class
from engine.model.model_info import ModelInfo, resolve_model
from engine.plugins import get_plugin_manager
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def selection_context(vllm_config: VllmConfig, model_info: ModelInfo) -> SelectionContext:
    num_groups = len(set(model_info.layer_sliding_windows)) + int(model_info.is_hybrid)  # Mamba layers: a group
    return SelectionContext(vllm_config, model_info, num_kv_cache_groups=num_groups)


def requested_plugins(vllm_config: VllmConfig, model_info: ModelInfo) -> dict[str, str]:
    """Kind -> the implementation the config asks for (``auto`` or a name), for the kinds chosen at start."""
    return {
        kind.name: vllm_config.get_key(kind.config_key)
        for kind in KINDS.values()
        if kind.config_key
        and kind.selected_at_start
        and kind.runner in (None, model_info.runner_type)
        and vllm_config.get_key(kind.config_key) != kind.off_value
    }


def select_plugins(vllm_config: VllmConfig, model_info: ModelInfo) -> dict:
    """Choose every single-choice plugin before any weight is loaded; ConfigError if one cannot run."""
    plugins = get_plugin_manager()
    ctx = selection_context(vllm_config, model_info)
    requested = requested_plugins(vllm_config, model_info)
    chosen = {kind: plugins.select(kind, name, ctx) for kind, name in requested.items()}
    for kind, impl in chosen.items():
        why = "as configured" if requested[kind] != "auto" else "auto: highest-priority available"
        logger.info("plugin %-21s %-10s from %s (%s)", kind, impl.name, impl.source, why)
    processors = plugins.active("logits_processor", ctx)
    logger.info("plugin %-21s %s", "logits_processor", ", ".join(f"{p.name} ({p.source})" for p in processors))
    return chosen


def plugin_report(vllm_config: VllmConfig, model_info: ModelInfo, chosen: dict) -> list[dict[str, Any]]:
    """The chosen implementation of each kind, where it comes from and why, and every other one of the kind with
    the reason it is not used (the live view's plugin table)."""
    rows = get_plugin_manager().table(selection_context(vllm_config, model_info))
    requested = requested_plugins(vllm_config, model_info)
    report = []
    for kind, impl in chosen.items():
        report.append(
            {
                "kind": kind,
                "chosen": impl.name,
                "source": impl.source,
                "contract": impl.contract,
                "why": "as configured" if requested.get(kind) != "auto" else "auto: highest-priority available",
                "others": [
                    {"name": row["name"], "available": row["available"] == "yes", "reason": row["reason"]}
                    for row in rows
                    if row["kind"] == kind and row["name"] != impl.name
                ],
            }
        )
    return report


def check_pipeline_parallel(vllm_config: VllmConfig, model_info: ModelInfo) -> None:
    """ConfigError unless the model can be cut into ``parallel.pipeline_parallel_size`` stages."""
    pp = vllm_config.parallel.pipeline_parallel_size
    if pp == 1:
        return
    model_cls = get_model_class(model_info.architecture)
    if not getattr(model_cls, "supports_pp", False):
        raise ConfigError(
            f"parallel.pipeline_parallel_size={pp}: the model class {model_cls.__qualname__} "
            f"({model_info.architecture}) does not support pipeline parallelism (it must set "
            "supports_pp and take intermediate_tensors); use parallel.pipeline_parallel_size=1"
        )
    num_layers = model_info.hf_config.num_hidden_layers
    if pp > num_layers:
        raise ConfigError(
            f"parallel.pipeline_parallel_size={pp} exceeds the model's {num_layers} layers: every "
            f"stage holds at least one; choose at most {num_layers}"
        )


def check_hybrid_model(vllm_config: VllmConfig, model_info: ModelInfo) -> None:
    """A model with Mamba layers: speculative decoding is refused with a ConfigError (prefix caching works: the
    Mamba states at block boundaries are cached, see ``MambaManager``)."""
    if not model_info.is_hybrid:
        return
    method = vllm_config.speculative.method
    if method != "none":
        raise ConfigError(
            f"speculative.method={method!r}: {model_info.architecture} has Mamba layers, whose running state cannot "
            "roll back rejected drafts; use speculative.method='none'"
        )


def check_pooling_model(vllm_config: VllmConfig, model_info: ModelInfo) -> None:
    """A pooling model: prefix caching is off (a pooled prompt is read whole, once), an encoder's prompts run whole
    (no chunked prefill: every token attends to every other); speculative decoding and LoRA are refused."""
    pooling = model_info.pooling
    if pooling is None:
        return
    if vllm_config.cache.enable_prefix_caching:
        logger.info("prefix caching is off for the pooling model %s", model_info.architecture)
        vllm_config.cache.enable_prefix_caching = False
    for key, value, off in (
        ("speculative.method", vllm_config.speculative.method, "none"),
        ("lora.enable_lora", vllm_config.lora.enable_lora, False),
    ):
        if value != off:
            raise ConfigError(f"{key}={value!r}: {model_info.architecture} is a pooling model; set {key}={off!r}")
    if pooling.encoder_only:
        scheduler = vllm_config.scheduler
        if scheduler.max_num_batched_tokens < model_info.max_model_len:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({scheduler.max_num_batched_tokens}) is below the context length "
                f"({model_info.max_model_len}) of {model_info.architecture}, an encoder whose prompts run whole in "
                "one step: raise it or lower model.max_model_len"
            )
        if scheduler.enable_chunked_prefill:
            logger.info("chunked prefill is off for the encoder %s: its prompts run whole", model_info.architecture)
            scheduler.enable_chunked_prefill = False


class EngineCore:
    """Owns the scheduler and the executor; one ``step`` is one forward pass of the batch.

    A request whose processing raises fails alone: a bad request at ``add_request`` is answered with an
    error output at once; a step that raises is rolled back (its requests preempted) and its requests
    rerun one per step until the failure names one of them, which finishes with ``finish_reason="error"``.
    Only ``EngineDeadError`` (a dead worker, a failed collective) ends the engine.
    """

    def __init__(self, vllm_config: VllmConfig, model_info: Optional[ModelInfo] = None):
        start = time.perf_counter()
        self.vllm_config = vllm_config
        self.model_info = model_info or resolve_model(vllm_config.model, vllm_config.pooler)
        check_hybrid_model(vllm_config, self.model_info)
        check_pooling_model(vllm_config, self.model_info)
        self.plugins = select_plugins(vllm_config, self.model_info)
        self._description: Optional[dict[str, Any]] = None  # describe(), once asked
        check_pipeline_parallel(vllm_config, self.model_info)
        choices = {kind: impl.name for kind, impl in self.plugins.items()}
        self.executor = self.plugins["executor"].cls(vllm_config, choices)
        self._has_experts: Optional[bool] = None  # known after the first get_stats: MoE layers report expert load
        stage_specs = self.executor.get_kv_cache_stage_specs()
        kv_specs = {name: spec for specs in stage_specs for name, spec in specs.items()}
        self.kv_cache_config = make_kv_cache_config(
            kv_specs,
            int(vllm_config.cache.kv_cache_memory),  # validated into bytes
            vllm_config.cache.num_gpu_blocks_override,
            self.model_info.max_model_len,
            [set(specs) for specs in stage_specs],
        )
        self.executor.initialize_kv_cache(self.kv_cache_config)
        self.structured_output_manager = StructuredOutputManager(vllm_config, self.model_info)
        self.scheduler = Scheduler(
            vllm_config,
            self.kv_cache_config,
            self.plugins["kv_cache_coordinator"].cls,
            self.model_info.max_model_len,
            self.structured_output_manager,
        )
        self.batch_queue: deque = deque()
        self.submitted_at: dict[int, float] = {}  # a step in the batch queue -> when it was submitted
        self.in_flight: list[SchedulerOutput] = []  # steps scheduled whose results are not applied yet
        self.error_outputs: list[EngineCoreOutput] = []  # requests that failed, to report with the next step
        # async scheduling: one step runs on a thread while the next is planned; pipeline parallelism: the
        # executor runs one step per stage at once (vLLM's batch queue)
        self.exec_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="execute") if vllm_config.scheduler.async_scheduling else None
        )
        self.batch_queue_size = 2 if self.exec_thread is not None else self.executor.max_concurrent_batches
        observability = vllm_config.observability
        self.recorder: Optional[FlightRecorder] = None
        if observability.flight_recorder:
            self.recorder = FlightRecorder(
                observability.flight_recorder,
                int(observability.flight_recorder_max_bytes),  # validated into bytes
                recording_header(vllm_config, self.plugins),
            )
            logger.info("flight recorder: recording into %s", self.recorder.folder)
        freeze_gc_heap()
        logger.info("engine core ready in %.1fs", time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.recorder is not None:
            self.recorder.request_added(request)
        try:
            self._check_request(request)
            self.scheduler.add_request(
                Request(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.eos_token_id,
                    self.kv_cache_config.block_size,
                    request.cache_salt,
                    request.arrival_time,
                    request.resumed_output_token_ids,
                    request.lora_request,
                    request.pooling_params,
                    request.priority,
                )
            )
        except Exception as exc:
            logger.warning("request %s refused by the engine core: %s", request.request_id, exc)
            self.error_outputs.append(
                EngineCoreOutput(request.request_id, [], "error", error=f"{type(exc).__name__}: {exc}")
            )

    def _check_request(self, request: EngineCoreRequest) -> None:
        """The front end validates; the core checks again whatever could break it (any client may send)."""
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.model_info.check_prompt_token_ids(request.prompt_token_ids)
        if request.resumed_output_token_ids:  # a migrated request: its tokens so far, as a longer prompt
            self.model_info.check_prompt_token_ids(request.prompt_token_ids + request.resumed_output_token_ids)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None and len(request.resumed_output_token_ids) >= max_tokens:
                raise ValueError(f"a resumed request already has its max_tokens ({max_tokens}) tokens")
        pooling = self.model_info.pooling
        if (request.pooling_params is None) != (pooling is None):
            raise ValueError(
                f"a {'generation' if request.pooling_params is None else 'pooling'} request cannot run on "
                f"{self.model_info.architecture}, a {self.model_info.runner_type} model"
            )
        if request.pooling_params is not None:
            assert pooling is not None
            request.pooling_params.validate_for_model(pooling.tasks, pooling.embedding_size, pooling.matryoshka)
            if request.resumed_output_token_ids or request.sampling_params.max_tokens != 1:
                raise ValueError("a pooling request ends with its prompt: max_tokens 1 and no resumed tokens")
        if request.lora_request is not None and not self.vllm_config.lora.enable_lora:
            raise ValueError(
                f"request names LoRA adapter {request.lora_request.lora_name!r} but LoRA is off (lora.enable_lora)"
            )
        vocab = self.model_info.vocab_size
        if request.eos_token_id is not None and not 0 <= request.eos_token_id < vocab:
            raise ValueError(f"eos_token_id must lie in [0, {vocab})")
        request.sampling_params.validate_for_model(vocab, self.vllm_config.model.max_logprobs)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        if self.recorder is not None:
            self.recorder.requests_aborted(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """One step; a failure that can be pinned to requests fails them, not the engine."""
        try:
            outputs = self.step_with_batch_queue() if self.batch_queue_size > 1 else self._step()
        except EngineDeadError:
            raise
        except Exception as exc:
            outputs = self._recover_from_failed_step(exc)
            if self.recorder is not None and outputs.outputs:
                self.recorder.step_done({}, {}, outputs.outputs)
        if self.scheduler.error_outputs:
            self.error_outputs += self.scheduler.error_outputs
            self.scheduler.error_outputs = []
        if self.error_outputs:
            if self.recorder is not None:
                self.recorder.step_done({}, {}, self.error_outputs)
            outputs.outputs[:0], self.error_outputs = self.error_outputs, []
        elif not outputs.outputs and self.scheduler.num_waiting_for_grammar():
            time.sleep(0.0005)  # only grammars compiling: leave the compile thread the CPU instead of spinning
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs([], self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        self.in_flight.append(scheduler_output)
        started = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler.record_step(scheduler_output, time.perf_counter() - started)
        self.in_flight.clear()
        self._record(scheduler_output, outputs)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Keep up to ``batch_queue_size`` steps in flight: plan and submit a step while there is room and work
        the in-flight steps do not cover (a request whose sampled token is still in flight waits), otherwise
        apply the oldest step's output."""
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                if self.exec_thread is not None:
                    future = self.exec_thread.submit(self.executor.execute_model, scheduler_output)
                else:
                    future = self.executor.execute_model(scheduler_output, non_block=True)
                self.batch_queue.append((scheduler_output, future))
                self.submitted_at[id(scheduler_output)] = time.perf_counter()
                self.in_flight.append(scheduler_output)
                if len(self.batch_queue) < self.batch_queue_size:
                    return EngineCoreOutputs([], self.scheduler.make_stats())  # let the next step be planned
            else:  # nothing to run now: the workers learn of finished requests with the next step
                self.scheduler.finished_req_ids.update(scheduler_output.finished_req_ids)
        if not self.batch_queue:
            return EngineCoreOutputs([], self.scheduler.make_stats())
        scheduler_output, future = self.batch_queue[0]
        outputs = self.scheduler.update_from_output(scheduler_output, future.result())
        started = self.submitted_at.pop(id(scheduler_output), None)
        if started is not None:
            self.scheduler.record_step(scheduler_output, time.perf_counter() - started)
        self.batch_queue.popleft()
        self.in_flight.remove(scheduler_output)
        self._record(scheduler_output, outputs)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def _record(self, scheduler_output: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        if self.recorder is not None:
            self.recorder.step_done(
                scheduler_output.num_scheduled_tokens,
                scheduler_output.scheduled_spec_decode_tokens,
                outputs,
                scheduler_output.preempted_req_ids,
            )

    def _recover_from_failed_step(self, exc: Exception) -> EngineCoreOutputs:
        """Pin a step's failure on its requests: one request fails; several are rolled back and isolated."""
        for _, future in self.batch_queue:  # steps planned on top of the failed one: wait, drop their results
            try:
                future.result()
            except Exception:
                pass
        self.batch_queue.clear()
        self.submitted_at.clear()
        failed, self.in_flight = self.in_flight, []
        for output in failed:
            self.scheduler.step_done(output)
        suspects = list(
            dict.fromkeys(
                rid for output in failed for rid in output.num_scheduled_tokens if rid in self.scheduler.requests
            )
        )
        if not suspects:
            raise exc  # not a request's step (the scheduler itself): nothing to pin it on
        for output in failed:  # the workers may not have dropped these yet
            self.scheduler.finished_req_ids.update(output.finished_req_ids)
        reason = f"{type(exc).__name__}: {exc}"
        if len(suspects) == 1:
            logger.error("request %s failed in the engine core and was ended: %s", suspects[0], reason, exc_info=exc)
            return EngineCoreOutputs(self.scheduler.fail_requests(suspects, reason), self.scheduler.make_stats())
        logger.warning(
            "a step of %d requests failed (%s); rerunning them one at a time to find the request that causes it",
            len(suspects),
            reason,
        )
        self.scheduler.isolate(suspects)
        return EngineCoreOutputs([], self.scheduler.make_stats())

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or bool(self.error_outputs)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if self._has_experts is not False:  # asked of the workers once; a dense model is not asked again
            stats.expert_load = self._expert_load()
            self._has_experts = bool(stats.expert_load)
        return stats

    def describe(self) -> dict[str, Any]:
        """What the live view shows of this core: the plugins chosen (and why the others are not used) and the
        product tables its workers measured (the first worker's: each rank measures the same shapes)."""
        if self._description is None:
            tables = self.executor.collective_rpc("product_tables")
            self._description = {
                "dp_rank": self.vllm_config.parallel.data_parallel_rank,
                "plugins": plugin_report(self.vllm_config, self.model_info, self.plugins),
                "product_tables": next((t for t in tables if t), {}),
            }
        return self._description

    def _expert_load(self) -> dict[int, list[int]]:
        """Tokens per expert per MoE layer, from every pipeline stage (its TP ranks count the same tokens)."""
        merged: dict[int, list[int]] = {}
        for load in self.executor.collective_rpc("expert_load"):
            merged.update(load)
        return dict(sorted(merged.items()))

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self.structured_output_manager.shutdown()
        if self.exec_thread is not None:
            self.exec_thread.shutdown(wait=True)
        self.executor.shutdown()
        release_gc_heap()
