"""LoRAModelManager: a worker's adapters, loaded on first use, kept up to ``max_cpu_loras``, and put into the layers'
``max_loras`` slots for the steps that run them (vLLM's ``LRUCacheWorkerLoRAManager``)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch

from engine.config import LoRAConfig
from engine.interfaces.layer_kernels import LayerKernels
from engine.lora.adapter import (
    ATTENTION_PROJECTIONS,
    SUPPORTED_MODULES,
    LoRAAdapterError,
    PEFTAdapter,
    lora_target_shapes,
    read_adapter,
)
from engine.lora.layers import LoRALinear, layer_slices
from engine.lora.mapping import LoRAMapping, PunicaWrapper
from engine.lora_request import LoRARequest

logger = logging.getLogger(__name__)

_BLOCKS = {proj: "self_attn" if proj in ATTENTION_PROJECTIONS else "mlp" for proj in SUPPORTED_MODULES}


class LoRAModelManager:
    """Attaches a :class:`LoRALinear` to every projection an adapter may target, loads adapters (this rank's
    shards), and maps each step's tokens to slots."""

    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: Any,
        lora_config: LoRAConfig,
        kernels: LayerKernels,
        device: torch.device,
    ):
        self.model = model
        self.config = lora_config
        self.max_loras = lora_config.max_loras
        self.capacity = lora_config.cpu_capacity
        self.num_layers = int(hf_config.num_hidden_layers)
        self.shapes = lora_target_shapes(hf_config)
        self.punica = PunicaWrapper()
        # checkpoint projection (model.layers.3.self_attn.q_proj) -> (LoRALinear, slice index)
        self.targets: dict[str, tuple[LoRALinear, int]] = {}
        self.layers: list[LoRALinear] = []
        self._attach(kernels, device)
        self.adapters: OrderedDict[int, PEFTAdapter] = OrderedDict()  # loaded, least recently used first
        self.requests: dict[int, LoRARequest] = {}
        self.slots: list[Optional[int]] = [None] * self.max_loras  # slot -> adapter id
        self._slot_age = [0] * self.max_loras
        self._clock = 0

    def _attach(self, kernels: LayerKernels, device: torch.device) -> None:
        modules = dict(self.model.named_modules())
        checkpoint_target = getattr(self.model, "checkpoint_target", None)
        by_module: dict[str, list[tuple[str, Any]]] = {}
        for layer in range(self.num_layers):
            for proj in self.shapes:
                name = f"model.layers.{layer}.{_BLOCKS[proj]}.{proj}"
                target, args = checkpoint_target(name + ".weight") if checkpoint_target else (name + ".weight", ())
                module_name = target.rsplit(".", 1)[0]
                if module_name not in modules:
                    continue  # another pipeline stage holds this layer (or the family names it otherwise)
                by_module.setdefault(module_name, []).append((name, args[0] if args else None))
        for module_name, projections in by_module.items():
            module = modules[module_name]
            if not hasattr(module, "lora"):
                raise LoRAAdapterError(f"{type(self.model).__name__}.{module_name} is not a layer LoRA can adapt")
            slices = layer_slices(module, [shard for _, shard in projections])
            lora = LoRALinear(module, slices, self.max_loras, self.config.max_lora_rank, self.punica, kernels, device)
            module.lora = lora
            self.layers.append(lora)
            for index, (name, _) in enumerate(projections):
                self.targets[name] = (lora, index)
        if not self.layers:
            raise LoRAAdapterError(f"{type(self.model).__name__} has no projection LoRA can adapt")
        logger.info(
            "LoRA: %d layers adaptable (%s), %d slots of rank %d",
            len(self.layers),
            ", ".join(self.shapes),
            self.max_loras,
            self.config.max_lora_rank,
        )

    # ---- adapters ------------------------------------------------------------------------------------
    def add_request(self, lora_request: LoRARequest) -> None:
        """Remember which folder an adapter id names (read when a step first runs it)."""
        known = self.requests.get(lora_request.lora_int_id)
        if known is not None and known.lora_path != lora_request.lora_path:
            self._unload(lora_request.lora_int_id)  # the id now names another folder
        self.requests[lora_request.lora_int_id] = lora_request

    def _load(self, lora_id: int) -> PEFTAdapter:
        adapter = self.adapters.get(lora_id)
        if adapter is not None:
            self.adapters.move_to_end(lora_id)
            return adapter
        request = self.requests[lora_id]
        adapter = read_adapter(
            request.lora_path, self.shapes, self.num_layers, self.config.max_lora_rank, load_weights=True
        )
        in_slots = {slot_id for slot_id in self.slots if slot_id is not None}
        while len(self.adapters) >= self.capacity:
            victim = next((i for i in self.adapters if i not in in_slots), None)
            if victim is None:
                break
            self.adapters.pop(victim)
        self.adapters[lora_id] = adapter
        logger.info(
            "LoRA adapter %s (id %d, rank %d) loaded from %s",
            request.lora_name,
            lora_id,
            adapter.rank,
            request.lora_path,
        )
        return adapter

    def _unload(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        for slot, held in enumerate(self.slots):
            if held == lora_id:
                self.slots[slot] = None
                for layer in self.layers:
                    layer.clear_slot(slot)

    def _activate(self, lora_id: int, needed: set[int]) -> int:
        """The slot holding adapter ``lora_id``, filling the least recently used slot no adapter of this step
        needs."""
        self._clock += 1
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
            self._slot_age[slot] = self._clock
            return slot
        free = [s for s, held in enumerate(self.slots) if held is None or held not in needed]
        if not free:
            raise RuntimeError(
                f"a step runs more distinct adapters than lora.max_loras ({self.max_loras}); the scheduler keeps "
                "them within it"
            )
        slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_age[s]))
        adapter = self._load(lora_id)
        per_layer: dict[int, list[Optional[tuple[torch.Tensor, torch.Tensor, float]]]] = {}
        for name, module in adapter.modules.items():
            lora, index = self.targets[name]
            entries = per_layer.setdefault(id(lora), [None] * len(lora.slices))
            assert module.lora_a is not None and module.lora_b is not None  # read with load_weights
            entries[index] = (module.lora_a, module.lora_b, module.scaling)
        for lora in self.layers:
            lora.set_slot(slot, per_layer.get(id(lora), [None] * len(lora.slices)))
        self.slots[slot] = lora_id
        self._slot_age[slot] = self._clock
        return slot

    # ---- steps -----------------------------------------------------------------------------------------
    def set_step(self, row_lora_ids: np.ndarray, num_scheduled: np.ndarray) -> Optional[LoRAMapping]:
        """Put the step's adapters into slots and map its tokens (row ``i`` runs ``num_scheduled[i]`` tokens
        with adapter id ``row_lora_ids[i]``, 0 = the base model); the layers read the mapping until
        ``clear_step``."""
        if not row_lora_ids.any():
            self.punica.mapping = None
            return None
        needed = set(np.unique(row_lora_ids[row_lora_ids > 0]).tolist())
        slot_of = {lora_id: self._activate(lora_id, needed) for lora_id in sorted(needed)}
        row_slots = np.full(len(row_lora_ids), -1, dtype=np.int64)
        for lora_id, slot in slot_of.items():
            row_slots[row_lora_ids == lora_id] = slot
        self.punica.mapping = LoRAMapping.from_token_slots(np.repeat(row_slots, num_scheduled))
        return self.punica.mapping

    def clear_step(self) -> None:
        self.punica.mapping = None
