"""Executor interface: runs workers and forwards calls to them."""

from __future__ import annotations

from abc import abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional, Union

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.config import VllmConfig


class Executor(Pluggable):
    """Owns the workers of one engine; the engine core talks to the model only through it."""

    def __init__(self, vllm_config: VllmConfig, plugin_choices: dict[str, str]):
        """``plugin_choices`` are the names already selected (attention, sampler, layer kernels...), for the workers."""
        self.vllm_config = vllm_config
        self.plugin_choices = plugin_choices
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model."""

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> list[Any]:
        """Call ``method`` on every worker; return the results, rank order."""

    def collective_rpc_async(
        self, method: str, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Future[list[Any]]:
        """``collective_rpc`` without waiting: a Future of the results. Executors whose workers run in other
        processes override it so that several steps can be in flight (pipeline parallelism); calls complete
        in the order they were made."""
        future: Future[list[Any]] = Future()
        try:
            future.set_result(self.collective_rpc(method, args, kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    @property
    def output_rank(self) -> int:
        """The rank whose step output is the engine's: the first TP rank of the last pipeline stage."""
        parallel = self.vllm_config.parallel
        return int(parallel.world_size - parallel.tensor_parallel_size)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may keep in flight: one per pipeline stage."""
        return int(self.vllm_config.parallel.pipeline_parallel_size)

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """Per-layer KV-cache specs of every layer (each pipeline stage's first rank gives its layers')."""
        merged: dict[str, Any] = {}
        for stage_specs in self.get_kv_cache_stage_specs():
            merged.update(stage_specs)
        return merged

    def get_kv_cache_stage_specs(self) -> list[dict[str, Any]]:
        """Per-layer KV-cache specs, one dict per pipeline stage (the layers that stage holds)."""
        specs = self.collective_rpc("get_kv_cache_spec")
        tp = self.vllm_config.parallel.tensor_parallel_size
        return [specs[rank] for rank in range(0, len(specs), tp)]

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        self.collective_rpc("initialize_kv_cache", (kv_cache_config,))

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Union[Any, Future[Any]]:
        """Run one step; returns the output rank's ModelRunnerOutput (a Future of it with ``non_block``)."""
        if not non_block:
            return self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]
        future = self.collective_rpc_async("execute_model", (scheduler_output,))
        output: Future[Any] = Future()

        def pick(done: Future[list[Any]]) -> None:
            error = done.exception()
            if error is not None:
                output.set_exception(error)
            else:
                output.set_result(done.result()[self.output_rank])

        future.add_done_callback(pick)
        return output

    def check_health(self) -> None:
        """Raise if a worker is dead."""

    @abstractmethod
    def shutdown(self) -> None: ...
