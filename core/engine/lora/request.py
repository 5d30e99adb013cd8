"""``engine.lora.request.LoRARequest``, where vLLM's users look for it (defined with the wire messages)."""

from engine.lora_request import LoRARequest

__all__ = ["LoRARequest"]
