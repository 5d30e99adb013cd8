"""UniProcExecutor: one worker, in the engine-core process, called directly."""

from __future__ import annotations

from typing import Any, Optional

from engine import hookimpl
from engine.interfaces.executor import Executor
from engine.worker.worker import Worker

ENGINE_CONTRACT_VERSION = "1.0"


class UniProcExecutor(Executor):
    """Runs a single rank in this process: no IPC, no copies of the step's plan."""

    name = "uniproc"
    priority = 20

    @classmethod
    def unavailable_reasons(cls, ctx) -> list[str]:
        parallel = ctx.config.parallel
        if parallel.world_size != 1:
            return [
                f"tensor_parallel_size={parallel.tensor_parallel_size} x pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size} needs one process per rank; uniproc runs one"
            ]
        return []

    def _init_executor(self) -> None:
        self.worker = Worker(self.vllm_config, self.plugin_choices, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker.shutdown()


@hookimpl
def engine_executors():
    return [UniProcExecutor]
