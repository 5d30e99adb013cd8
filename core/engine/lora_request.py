"""LoRARequest: the adapter one request runs with (vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``), a wire
message like the sampling parameters (``engine.lora.request`` re-exports it under vLLM's path)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """A PEFT adapter folder under a name and a positive integer id (the id tells adapters apart in the worker's
    slots; the name keeps their prefix-cache blocks apart). Travels with the request to the engine core and the
    workers, which load the folder the first time they see the id."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def prefix_key(self) -> tuple[str, int]:
        """What keeps this adapter's prefix-cache blocks apart from every other's."""
        return (self.lora_name, self.lora_int_id)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
