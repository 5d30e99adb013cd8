"""Worker: one rank's device, model runner and plugin instances; it only executes what it is told."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from engine.config import VllmConfig
from engine.devices import resolve_device
from engine.distributed.parallel_state import destroy_model_parallel, init_model_parallel
from engine.huge_pages import apply_huge_page_policy
from engine.interfaces.base import SelectionContext
from engine.kv_cache.spec import KVCacheConfig, KVCacheSpec
from engine.model.model_info import resolve_model
from engine.plugins import get_plugin_manager
from engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.thread_policy import warn_if_not_in_effect
from engine.worker.heap_policy import apply_heap_policy, release_freed_memory
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """Created by an Executor in whatever process holds the rank; resolves plugins by name itself."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        plugin_choices: dict[str, str],
        rank: int = 0,
        distributed_init_method: Optional[str] = None,
        device_index: Optional[int] = None,
    ):
        """``device_index``: the CUDA device to use when the executor knows it (a Ray actor sees only its own
        GPU, device 0); by default DP rank x TP + rank."""
        self.vllm_config = vllm_config
        self.plugin_choices = plugin_choices
        self.rank = rank
        self.device_index = device_index
        self.distributed_init_method = distributed_init_method
        self.model_runner: Optional[ModelRunner] = None

    def init_device(self) -> None:
        device_name = resolve_device(self.vllm_config.device.device)
        parallel = self.vllm_config.parallel
        world = parallel.world_size
        # DP rank r's TP x PP ranks take devices r*W .. r*W+W-1
        index = self.device_index if self.device_index is not None else parallel.data_parallel_rank * world + self.rank
        self.device = torch.device("cuda", index) if device_name == "cuda" else torch.device("cpu")
        threads = self.vllm_config.device.num_threads
        if threads is None and device_name == "cpu" and world * parallel.data_parallel_size > 1:
            # workers of every DP, TP and PP rank share the cores; oversubscribed OpenMP crawls
            threads = parallel.threads_per_worker(os.cpu_count() or 1)
        if threads:
            torch.set_num_threads(threads)
        if device_name == "cpu":
            warn_if_not_in_effect()
            if self.vllm_config.device.keep_freed_memory:
                apply_heap_policy()
            apply_huge_page_policy(self.vllm_config.device.huge_pages)
        torch.manual_seed(self.vllm_config.model.seed)
        init_model_parallel(
            self.rank,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            self.distributed_init_method or "env://",
            "nccl" if device_name == "cuda" else "gloo",
            parallel.enable_expert_parallel,
        )

    def load_model(self) -> None:
        info = resolve_model(self.vllm_config.model, self.vllm_config.pooler)
        plugins = get_plugin_manager()
        ctx = SelectionContext(self.vllm_config, info)
        attention = plugins.select("attention", self.plugin_choices["attention"], ctx)
        sampler = plugins.select("sampler", self.plugin_choices["sampler"], ctx)
        kernels = plugins.select("layer_kernels", self.plugin_choices["layer_kernels"], ctx)
        quantization = plugins.select("quantization", self.plugin_choices.get("quantization", "auto"), ctx)
        processors = [impl.create(self.vllm_config) for impl in plugins.active("logits_processor", ctx)]
        proposer_name = self.plugin_choices.get("proposer")  # absent: speculative decoding is off
        proposer = plugins.select("proposer", proposer_name, ctx).create(self.vllm_config) if proposer_name else None
        pooler = (
            plugins.select("pooler", self.plugin_choices["pooler"], ctx).create(self.vllm_config)
            if info.pooling is not None
            else None
        )
        layer_kernels = kernels.cls()
        layer_kernels.configure(self.vllm_config)
        self.model_runner = ModelRunner(
            self.vllm_config,
            info,
            self.device,
            attention.cls,
            sampler.create(self.vllm_config),
            processors,
            layer_kernels,
            quantization.create(),
            proposer,
            pooler,
        )
        self.model_runner.load_model()
        if self.device.type == "cpu" and self.vllm_config.device.keep_freed_memory:
            release_freed_memory()  # what loading freed, kept mapped by the heap policy's trim threshold

    @property
    def runner(self) -> ModelRunner:
        """The model runner (there once ``load_model`` has run)."""
        if self.model_runner is None:
            raise RuntimeError("the worker has no model runner before load_model")
        return self.model_runner

    def expert_load(self) -> dict[int, list[int]]:
        return self.runner.expert_load()

    def product_tables(self) -> dict[str, Any]:
        return self.runner.product_tables()

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.runner.get_kv_cache_spec()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        return self.runner.execute_model(scheduler_output)

    def check_health(self) -> bool:
        return True

    def shutdown(self) -> None:
        destroy_model_parallel()
