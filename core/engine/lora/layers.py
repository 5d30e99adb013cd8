"""LoRALinear: the adapters' weights of one linear layer, stacked by slot, and their product added to its output."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from engine.interfaces.layer_kernels import LayerKernels
from engine.lora.mapping import PunicaWrapper
from engine.model.layers.linear import QKVParallelLinear, RowParallelLinear


@dataclass(frozen=True)
class LoRASlice:
    """Where one checkpoint projection (q_proj, gate_proj...) lands in this rank's shard of a (merged) layer:
    ``out_offset`` and ``out_size`` in the layer's output, rows ``src_offset..+out_size`` of the full B (column
    parallel), or columns ``in_start..+in_size`` of the full A (row parallel, B whole)."""

    shard_id: Any
    out_offset: int
    out_size: int
    src_offset: int
    in_start: int
    in_size: int


def layer_slices(module: Any, shard_ids: Sequence[Any]) -> list[LoRASlice]:
    """The slices of ``module`` that the checkpoint projections ``shard_ids`` fill, as its weight loader shards
    them (A replicated and B sharded by output for column-parallel layers; A sharded by input, B whole, for
    row-parallel ones: each rank's delta is then a partial sum, all-reduced with the layer's output)."""
    if isinstance(module, RowParallelLinear):
        start, size = module.input_start, module.input_size_per_partition
        return [LoRASlice(None, 0, module.output_size, 0, start, size)]
    in_size = module.input_size
    slices = []
    for shard_id in shard_ids:
        if isinstance(module, QKVParallelLinear):
            offset, first_head, heads = module.shards[shard_id]
            size = module.head_size
            slices.append(LoRASlice(shard_id, offset * size, heads * size, first_head * size, 0, in_size))
        else:
            offset, size, src = module.shard_bounds(shard_id)
            slices.append(LoRASlice(shard_id, offset, size, src, 0, in_size))
    return slices


class LoRALinear:
    """The LoRA weights of one linear layer for ``max_loras`` slots: ``lora_a [slots, n_slices * R, in]`` and
    ``lora_b [out, slots, n_slices * R]`` (R = max_lora_rank; each slice's A rows and B columns side by side, B
    block-diagonal, the scaling folded into B), zero where a slot's adapter does not reach."""

    def __init__(
        self,
        module: Any,
        slices: list[LoRASlice],
        max_loras: int,
        max_rank: int,
        punica: PunicaWrapper,
        kernels: LayerKernels,
        device: torch.device,
    ):
        self.slices = slices
        self.max_rank = max_rank
        self.punica = punica
        self.kernels = kernels
        in_size = slices[0].in_size
        out_size = module.output_size if isinstance(module, RowParallelLinear) else module.output_size_per_partition
        width = len(slices) * max_rank
        self.lora_a = torch.zeros(max_loras, width, in_size, dtype=torch.float32, device=device)
        self.lora_b = torch.zeros(out_size, max_loras, width, dtype=torch.float32, device=device)
        # where B is not zero: slice i's output rows take its own R columns (a 1.13 kernel gets no out_slices)
        self.out_slices = tuple((piece.out_offset, piece.out_size) for piece in slices)
        takes_slices = "out_slices" in inspect.signature(kernels.add_lora).parameters
        self.product_kwargs: dict[str, Any] = {"out_slices": self.out_slices} if takes_slices else {}

    def set_slot(self, slot: int, weights: Sequence[Optional[tuple[torch.Tensor, torch.Tensor, float]]]) -> None:
        """Fill ``slot`` with one adapter: per slice, its full ``(A [r, in], B [out, r], scaling)`` or None where the
        adapter leaves that projection alone."""
        self.clear_slot(slot)
        for index, (piece, entry) in enumerate(zip(self.slices, weights)):
            if entry is None:
                continue
            a, b, scaling = entry
            rank = a.shape[0]
            column = index * self.max_rank
            self.lora_a[slot, column : column + rank].copy_(a[:, piece.in_start : piece.in_start + piece.in_size])
            shard_b = b[piece.src_offset : piece.src_offset + piece.out_size] * scaling
            self.lora_b[piece.out_offset : piece.out_offset + piece.out_size, slot, column : column + rank].copy_(
                shard_b
            )

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[:, slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` with each token's adapter product added (unchanged when no token of this step has one)."""
        mapping = self.punica.mapping
        if mapping is None:
            return y
        return self.kernels.add_lora(y, x, self.lora_a, self.lora_b, mapping, **self.product_kwargs)
