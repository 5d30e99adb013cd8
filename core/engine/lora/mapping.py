"""LoRAMapping: which adapter slot each token of a step runs with, grouped by slot (vLLM's punica metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Union

import numpy as np
import torch

Rows = Union[slice, torch.Tensor]  # a run of consecutive tokens, or their indices (int64)


@dataclass(frozen=True)
class LoRAMapping:
    """A step's tokens grouped by adapter slot: ``groups`` holds ``(slot, rows)`` for every slot that has tokens
    this step, in slot order; tokens of the base model are in no group. ``token_slots`` is each token's slot (-1:
    the base model), for kernels that index per token."""

    num_tokens: int
    groups: tuple[tuple[int, Rows], ...]
    token_slots: torch.Tensor

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray) -> Optional[LoRAMapping]:
        """The mapping of a step whose token ``i`` runs with slot ``token_slots[i]`` (-1: none); None when no
        token runs with an adapter (the layers then skip LoRA altogether)."""
        slots = np.unique(token_slots[token_slots >= 0])
        if len(slots) == 0:
            return None
        groups: list[tuple[int, Rows]] = []
        for slot in slots.tolist():
            rows = np.flatnonzero(token_slots == slot)
            if rows[-1] - rows[0] + 1 == len(rows):  # one run: a view, no gather
                groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                groups.append((slot, torch.from_numpy(rows.astype(np.int64))))
        return cls(len(token_slots), tuple(groups), torch.from_numpy(token_slots.astype(np.int64)))

    @property
    def num_slots(self) -> int:
        """Slots ``0..num_slots - 1`` cover every token's slot (a kernel may run all of them at once)."""
        return self.groups[-1][0] + 1

    @cached_property
    def slot_mask(self) -> torch.Tensor:
        """``[T, num_slots, 1]`` float32: 1 where token ``t`` runs with slot ``s`` (every row zero for the base
        model's tokens), for kernels that compute every slot's shrink and keep each token's own."""
        slots = torch.arange(self.num_slots).view(1, -1)
        return (self.token_slots.view(-1, 1) == slots).to(torch.float32).unsqueeze(-1)


class PunicaWrapper:
    """The step's mapping, shared by every LoRA layer of a model (the runner sets it before each forward)."""

    def __init__(self) -> None:
        self.mapping: Optional[LoRAMapping] = None
