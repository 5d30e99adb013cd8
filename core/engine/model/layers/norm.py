"""RMSNorm, computed in float32 as the reference implementations do, through the layer kernels."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.model.layers.kernels import current_layer_kernels


class RMSNorm(nn.Module):
    """``norm(x)``; with a residual, ``norm(x, residual)`` adds it first and returns
    ``(normalised sum, sum)`` (vLLM's fused residual form)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernels = current_layer_kernels()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
