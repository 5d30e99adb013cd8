"""The batched LoRA product in torch (vLLM's punica shrink/expand): the reference every kernel is checked against."""

from __future__ import annotations

from typing import Any

import torch


def add_lora(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: Any
) -> torch.Tensor:
    """``y[t] += B[:, s] (A[s] x[t])`` for every token ``t`` of slot ``s`` (``mapping.groups``: the step's tokens
    grouped by slot), in place; the products run in the adapters' dtype, once per slot with tokens (a run of
    consecutive tokens is a view, scattered ones are gathered)."""
    for slot, rows in mapping.groups:
        a, b = lora_a[slot], lora_b[:, slot]
        if isinstance(rows, slice):
            shrunk = torch.mm(x[rows].to(a.dtype), a.t())
            y[rows] += torch.mm(shrunk, b.t()).to(y.dtype)
        else:
            shrunk = torch.mm(x.index_select(0, rows).to(a.dtype), a.t())
            y.index_add_(0, rows, torch.mm(shrunk, b.t()).to(y.dtype))
    return y
