"""SiLU-and-multiply over a merged gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.kernels import current_layer_kernels


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.kernels = current_layer_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)
