"""AsyncLLM: many concurrent requests over an engine core in its own process."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import AsyncGenerator, Optional, Union

from engine.beam_search import BeamSearchInstance, BeamSearchOutput, BeamSearchParams
from engine.config import VllmConfig
from engine.errors import EngineDeadError, EngineGenerateError, EngineUnavailableError
from engine.frontend.core_client import AsyncMPClient, RemoteEngines
from engine.frontend.input_processor import PreparedRequest, PromptType, build_front_end
from engine.lora_request import LoRARequest
from engine.messages import SchedulerStats
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """``async for output in engine.generate(prompt, params, request_id)``; cancelling aborts."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cancel_start: Optional[threading.Event] = None,
        remote: Optional[RemoteEngines] = None,
    ):
        """Start the engine cores (one per DP rank) and wait until they are ready; with ``remote``, join cores
        that another process started instead. Setting ``cancel_start`` (from another thread) makes a start-up
        in progress stop the cores and raise EngineDeadError."""
        # AsyncLLM always runs its engine core in a process of its own: the config says so (and the log)
        self.vllm_config = vllm_config.model_copy(deep=True)
        self.vllm_config.parallel.engine_core_process = True
        vllm_config = self.vllm_config
        logger.info("engine config:\n%s", vllm_config.summary())
        # the core process loads the model while this process reads the tokenizer: start-up overlaps
        self.engine_core = AsyncMPClient(vllm_config, remote)
        if cancel_start is not None:
            self.engine_core.cancel_start = cancel_start
        try:
            self.model_info, self.tokenizer, self.input_processor, self.output_processor = build_front_end(vllm_config)
            self.engine_core.wait_ready()
        except BaseException:
            self.engine_core.abort_start()
            raise
        self.queues: dict[str, asyncio.Queue] = {}
        self.output_handler: Optional[asyncio.Task] = None
        self.dead_error: Optional[EngineDeadError] = None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> AsyncLLM:
        return cls(vllm_config)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def watch(self) -> None:
        """Run the output handler from now on (call inside the event loop): it also watches the engine cores,
        so a core that dies is restarted, and ``errored`` set, even while no request runs."""
        self._ensure_output_handler()

    def _ensure_output_handler(self) -> None:
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        """Pull outputs from the core, turn them into RequestOutputs, hand each to its request's queue."""
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                outputs, stopped = self.output_processor.process_outputs(core_outputs)
                for output in outputs:
                    waiting = self.queues.get(output.request_id)
                    if waiting is not None:
                        waiting.put_nowait(output)
                if stopped:
                    await self.engine_core.abort_requests_async(stopped)
        except EngineDeadError as exc:
            logger.error("the engine is dead: %s", exc)
            self.dead_error = exc
            for waiting in self.queues.values():
                waiting.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the front end must not hang the callers
            logger.exception("output handler failed")
            self.dead_error = EngineDeadError(f"output handler failed: {exc}")
            for waiting in self.queues.values():
                waiting.put_nowait(self.dead_error)

    def prepare(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: Optional[str] = None,
        check_context_length: bool = False,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> PreparedRequest:
        """Validate and tokenize a prompt for ``generate`` (ValueError naming what is wrong); the OpenAI server
        prepares every prompt of a call, with the context-length check, before it starts any."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        return self.input_processor.prepare(
            request_id,
            prompt,
            sampling_params,
            check_context_length=check_context_length,
            lora_request=lora_request,
            priority=priority,
        )

    def prepare_pooling(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: Optional[str] = None,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> PreparedRequest:
        """Validate and tokenize a pooling request's prompt for ``encode`` (InvalidParameterError naming what is
        wrong, e.g. a pooling request to a generative model)."""
        request_id = request_id if request_id is not None else f"pool-{next(self._ids)}"
        return self.input_processor.prepare_pooling(request_id, prompt, pooling_params, truncate_prompt_tokens)

    async def encode(
        self,
        prompt: Union[PromptType, PreparedRequest],
        pooling_params: Optional[PoolingParams] = None,
        request_id: Optional[str] = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Yield the pooling request's one output (embedding, probabilities, score) once its prompt has run; errors
        as ``generate``."""
        if not isinstance(prompt, PreparedRequest):
            prompt = self.prepare_pooling(prompt, pooling_params or PoolingParams(task="encode"), request_id)
        async for output in self.generate(prompt):
            if output.finished:
                yield PoolingRequestOutput.from_request_output(output)

    def decode_token(self, token_id: int) -> Optional[str]:
        """One token's text, as logprobs show it (cached)."""
        return self.output_processor.decode_token(token_id)

    async def generate(
        self,
        prompt: Union[PromptType, PreparedRequest],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's (cumulative) output after each step until it finishes. ``prompt`` is a prompt
        (then ``sampling_params`` are needed) or a ``PreparedRequest``, which is used as it is.

        Raises ValueError for a bad prompt or parameters, EngineGenerateError when the engine core could not
        process this request (the engine serves the others), EngineUnavailableError when no engine core is up
        (restarting) or the request's core died with no other to take it over, EngineDeadError when the engine
        is gone."""
        if self.dead_error:
            raise self.dead_error
        self._ensure_output_handler()
        if isinstance(prompt, PreparedRequest):
            prepared = prompt
        else:
            if sampling_params is None:
                raise ValueError("generate needs sampling_params with a prompt (or a PreparedRequest)")
            prepared = self.prepare(prompt, sampling_params, request_id, lora_request=lora_request, priority=priority)
        request_id = prepared.request_id
        waiting: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = waiting
        self.output_processor.add_request(request_id, prepared.prompt_text, prepared.requests)
        finished = False
        try:
            for request in prepared.requests:
                await self.engine_core.add_request_async(request)
            while not finished:
                item = await waiting.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # the finally aborts its other sequences, if any
                    lost = [self.engine_core.lost_reason(r.request_id) for r in prepared.requests]
                    if any(lost):  # its engine core died with no other to take it over: retrying can succeed
                        raise EngineUnavailableError(f"request {request_id} failed: {next(r for r in lost if r)}")
                    raise EngineGenerateError(f"request {request_id} failed in the engine: {item.error}")
                finished = item.finished
                yield item
        finally:
            self.queues.pop(request_id, None)
            if not finished and not self.dead_error:  # cancelled, or the caller stopped iterating
                await self.abort(request_id)

    async def beam_search(
        self,
        prompt: PromptType,
        params: BeamSearchParams,
        request_id: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> BeamSearchOutput:
        """Beam search over one prompt (``engine.beam_search``): each step runs the live beams as concurrent
        one-token requests that share their prefixes through the prefix cache; cancelling aborts them."""
        request_id = request_id if request_id is not None else f"beam-{next(self._ids)}"
        instance = BeamSearchInstance(
            self.input_processor.tokenize(prompt)[1], params, self.input_processor.eos_token_id()
        )
        step_params, max_len = params.step_params(), self.model_info.max_model_len

        async def extend(beam_id: str, tokens: list[int]):
            if len(tokens) >= max_len:
                return None  # at the context length: the beam ends
            final = None
            prepared = self.prepare(
                {"prompt_token_ids": tokens}, step_params, beam_id, lora_request=lora_request, priority=priority
            )
            async for final in self.generate(prepared):  # noqa: B007 (the last one)
                pass
            assert final is not None and final.outputs[0].logprobs  # generate raises rather than end without output
            return final.outputs[0].logprobs[0]

        for step in range(params.max_tokens):
            if instance.done:
                break
            positions = await asyncio.gather(
                *(extend(f"{request_id}-{step}-{i}", beam.tokens) for i, beam in enumerate(instance.beams))
            )
            instance.advance(list(positions))
        return instance.result(self.tokenizer)

    async def abort(self, request_id: str) -> None:
        sequence_ids = self.output_processor.sequence_ids(request_id)
        self.output_processor.abort_requests([request_id])
        await self.engine_core.abort_requests_async(sequence_ids)

    async def get_stats(self) -> SchedulerStats:
        """Fresh counters from the cores: with data parallelism their total, each rank's in ``per_rank``."""
        self._ensure_output_handler()
        return await self.engine_core.call_utility_async("get_stats")

    async def describe(self) -> list[dict]:
        """Each live engine core's plugins (chosen, why, the others and why not) and measured product tables."""
        self._ensure_output_handler()
        answer = await self.engine_core.call_utility_async("describe")
        return answer if isinstance(answer, list) else [answer]

    async def reset_prefix_cache(self) -> bool:
        self._ensure_output_handler()
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def check_health(self) -> None:
        """Raise unless every engine core that is up answers (EngineUnavailableError: none is up)."""
        if self.dead_error:
            raise self.dead_error
        self._ensure_output_handler()
        await self.engine_core.call_utility_async("check_health")

    def engine_core_pids(self) -> list[int]:
        """The pids of the engine-core processes this front end started or joined, by DP rank."""
        return list(self.engine_core.engines.pids[: self.engine_core.num_ranks])

    def health(self) -> dict:
        """Each DP rank's state (up, starting, down, given_up), core deaths, restarts and migrated requests."""
        report = self.engine_core.health()
        if self.dead_error:
            report["status"], report["reason"] = "dead", str(self.dead_error)
        return report

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
