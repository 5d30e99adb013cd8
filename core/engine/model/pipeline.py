"""Pipeline-parallel model pieces: the stand-in for layers another stage holds, and the test that skips their
checkpoint tensors when this stage loads its weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# what one stage hands the next: the residual stream's named tensors, [num_tokens, hidden_size] each
IntermediateTensors = dict[str, torch.Tensor]


class PPMissingLayer(nn.Identity):
    """A layer (or the embedding, or the final norm) that another pipeline stage holds: no parameters here."""


_ABSENT = object()


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether checkpoint parameter ``name`` belongs to a module another stage holds (so this stage skips it):
    a ``PPMissingLayer`` on its path, or an attribute set to None (the LM head off the last stage)."""
    module: Any = model
    for part in name.split(".")[:-1]:
        if isinstance(module, nn.ModuleList):
            module = module[int(part)] if part.isdigit() and int(part) < len(module) else _ABSENT
        else:
            module = getattr(module, part, _ABSENT)
        if module is _ABSENT:
            return False  # not a parameter of this model at all: the loader reports it
        if module is None or isinstance(module, PPMissingLayer):
            return True
    return False
