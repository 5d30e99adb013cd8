"""LoRAResolver interface: finds an adapter by name when a request names one the server has not loaded (vLLM's
``lora_resolver`` plugins). Every available resolver is asked, by priority, until one answers."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Optional

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.lora_request import LoRARequest


class LoRAResolver(Pluggable):
    """Constructed once per API server as ``cls(vllm_config)``; ``resolve_lora`` runs on the event loop for each
    request that names an unknown model (do slow work in a thread)."""

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config

    @abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> Optional[LoRARequest]:
        """The adapter called ``lora_name`` for the served ``base_model_name``, or None when this resolver does not
        know it. ``lora_name`` comes from a client: never let it name a path outside what the operator allowed.
        The server checks the adapter (shapes, rank) before serving it; ``lora_int_id`` may be any positive int
        (the server assigns its own)."""
