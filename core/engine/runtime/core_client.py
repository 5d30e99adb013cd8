"""EngineCoreClient: the boundary between the front end and the engine core."""
from __future__ import annotations

from abc import ABC, abstractmethod

from engine.config import VllmConfig
from engine.model.model_info import ModelInfo
from engine.runtime.engine_core import EngineCore
from engine.runtime.messages import EngineCoreOutputs, EngineCoreRequest
from engine.scheduler.scheduler import SchedulerStats


class EngineCoreClient(ABC):
    """What a front end may ask of an engine core, wherever the core runs."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def get_stats(self) -> SchedulerStats: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process: ``get_output`` runs one step."""

    def __init__(self, vllm_config: VllmConfig, model_info: ModelInfo):
        self.engine_core = EngineCore(vllm_config, model_info)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
