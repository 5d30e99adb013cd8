"""LLMEngine: front end (input / output processing) over an EngineCoreClient."""

from __future__ import annotations

import itertools
import logging
from typing import Optional

from engine.config import VllmConfig
from engine.frontend.core_client import EngineCoreClient, make_client
from engine.frontend.input_processor import PromptType, build_front_end
from engine.lifetime import freeze_gc_heap, release_gc_heap, use_thread_lock_for_progress_bars
from engine.lora_request import LoRARequest
from engine.messages import SchedulerStats
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Synchronous engine: ``add_request`` then ``step`` until no request is left."""

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        use_thread_lock_for_progress_bars()  # no multiprocessing semaphore for this process's bars to leak
        logger.info("engine config:\n%s", vllm_config.summary())
        self.model_info, self.tokenizer, self.input_processor, self.output_processor = build_front_end(vllm_config)
        self.engine_core: EngineCoreClient = make_client(vllm_config, self.model_info)
        self._ids = itertools.count()
        freeze_gc_heap()

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        prepared = self.input_processor.prepare(
            request_id, prompt, params, lora_request=lora_request, priority=priority
        )
        self.output_processor.add_request(request_id, prepared.prompt_text, prepared.requests)
        for request in prepared.requests:
            self.engine_core.add_request(request)
        return request_id

    def add_pooling_request(
        self,
        prompt: PromptType,
        params: PoolingParams,
        request_id: Optional[str] = None,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        prepared = self.input_processor.prepare_pooling(request_id, prompt, params, truncate_prompt_tokens)
        self.output_processor.add_request(request_id, prepared.prompt_text, prepared.requests)
        for request in prepared.requests:
            self.engine_core.add_request(request)
        return request_id

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort user requests (every sequence of each); returns their final outputs."""
        self.engine_core.abort_requests([seq for rid in request_ids for seq in self.output_processor.sequence_ids(rid)])
        return self.output_processor.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process_outputs(self.engine_core.get_output())
        if stopped:  # stop strings end sequences the core does not know are done
            self.engine_core.abort_requests(stopped)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        release_gc_heap()
