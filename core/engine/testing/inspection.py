"""``inspect(llm)``: the parts of a running engine that tests and plugin authors look at, by name, instead of
reaching through ``llm.llm_engine.engine_core.engine_core.executor.worker...``."""

from __future__ import annotations

from typing import Any


class EngineInspector:
    """Read access to one ``LLM``'s (or ``LLMEngine``'s) parts. The engine core's parts exist only when it runs
    in this process (the default, without data parallelism); the worker's only with the uniproc executor.
    Asking for a part this engine does not have in this process raises LookupError saying why."""

    def __init__(self, llm: Any):
        self.llm_engine = getattr(llm, "llm_engine", llm)

    @property
    def client(self) -> Any:
        """The EngineCoreClient: InprocClient, or SyncMPClient over ZMQ."""
        return self.llm_engine.engine_core

    @property
    def engine_core(self) -> Any:
        core = getattr(self.client, "engine_core", None)
        if core is None:
            raise LookupError(f"the engine core runs in another process ({type(self.client).__name__})")
        return core

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def kv_cache_manager(self) -> Any:
        return self.scheduler.kv_cache_manager

    @property
    def structured_output_manager(self) -> Any:
        return self.engine_core.structured_output_manager

    @property
    def plugins(self) -> dict[str, Any]:
        """The implementation chosen for each plugin kind (``.name``, ``.cls``, ``.source``)."""
        return dict(self.engine_core.plugins)

    @property
    def executor(self) -> Any:
        return self.engine_core.executor

    @property
    def worker(self) -> Any:
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise LookupError(f"the workers run in other processes ({type(self.executor).__name__})")
        return worker

    @property
    def model_runner(self) -> Any:
        return self.worker.runner

    @property
    def model(self) -> Any:
        """The loaded torch model (its layers carry the packed products and KV caches)."""
        return self.model_runner.loaded_model


def inspect(llm: Any) -> EngineInspector:
    """The parts of ``llm`` (an ``LLM`` or ``LLMEngine``) by name: ``inspect(llm).scheduler``, ``.model``..."""
    return EngineInspector(llm)
