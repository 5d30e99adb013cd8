"""Executor interface: runs workers and forwards calls to them."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Optional

from engine.interfaces.base import Pluggable


class Executor(Pluggable):
    """Owns the workers of one engine; the engine core talks to the model only through it."""

    def __init__(self, vllm_config, plugin_choices: dict[str, str]):
        """``plugin_choices`` are the names already selected (attention, sampler, layer kernels...), for the workers."""
        self.vllm_config = vllm_config
        self.plugin_choices = plugin_choices
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        """Call ``method`` on every worker; return the results, rank order."""

    def get_kv_cache_spec(self) -> dict:
        """Per-layer KV-cache specs, from rank 0."""
        return self.collective_rpc("get_kv_cache_spec")[0]

    def initialize_kv_cache(self, kv_cache_config) -> None:
        self.collective_rpc("initialize_kv_cache", (kv_cache_config,))

    def execute_model(self, scheduler_output):
        """Run one step; returns rank 0's ModelRunnerOutput."""
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def check_health(self) -> None:
        """Raise if a worker is dead."""

    @abstractmethod
    def shutdown(self) -> None:
        ...
