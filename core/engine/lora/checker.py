"""LoRAAdapterChecker: the front end reads each adapter's config and tensor shapes once, before any request that
names it reaches the engine core, so that a bad adapter is refused with the reason (400) and never loaded."""

from __future__ import annotations

import threading
from typing import Any

from engine.config import LoRAConfig
from engine.lora.adapter import LoRAAdapterError, PEFTAdapter, lora_target_shapes, read_adapter
from engine.lora_request import LoRARequest


class LoRAAdapterChecker:
    """Checks adapters against the base model (``hf_config``), remembering the ones that passed by (id, path)."""

    def __init__(self, lora_config: LoRAConfig, hf_config: Any):
        self.config = lora_config
        self.hf_config = hf_config
        self._checked: dict[tuple[int, str], PEFTAdapter] = {}
        self._lock = threading.Lock()

    def check(self, lora_request: LoRARequest) -> PEFTAdapter:
        """The adapter's description; ``LoRAAdapterError`` saying what is wrong with it (or that LoRA is off)."""
        if not self.config.enable_lora:
            raise LoRAAdapterError(
                f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is off; start the engine with "
                "--enable-lora (lora.enable_lora)"
            )
        key = (lora_request.lora_int_id, lora_request.lora_path)
        with self._lock:
            known = self._checked.get(key)
        if known is not None:
            return known
        shapes = lora_target_shapes(self.hf_config)
        num_layers = int(self.hf_config.num_hidden_layers)
        adapter = read_adapter(lora_request.lora_path, shapes, num_layers, self.config.max_lora_rank)
        with self._lock:
            self._checked[key] = adapter
        return adapter
