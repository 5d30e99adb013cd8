"""The ``cpu`` layer kernels' linear products: float32 weights packed once into 16-column panels for
the AVX2 register-tile GEMM of ``csrc/gemm.cpp``.

On a 2-core AVX2 machine it runs SmolLM2's shapes at 120-172 GFLOP/s from 16 rows up, against 69-151
for oneDNN's packed product (``python scripts/bench_cpu_gemm.py``), and each output row depends only
on its own input row: a request's logits do not change with the batch it shares a step with.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

PANEL = 16  # output columns per packed panel (two AVX2 vectors)


class CpuPackedLinear:
    """``x @ weight.T + bias`` on the weight packed as ``[ceil(N/16), K, 16]`` float32 panels;
    computes in float32 and returns x's dtype (so bfloat16 activations get a bfloat16 GEMM with
    float32 accumulation)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        from engine_attention_cpu import _gemm

        self.out_features, self.in_features = weight.shape
        self.panels = _gemm.pack_weight(weight.detach().float())
        self.bias = None
        if bias is not None:  # padded to the panels, so the kernel's last tile reads no further than its own
            self.bias = torch.zeros(self.panels.shape[0] * PANEL)
            self.bias[: self.out_features] = bias.detach().float()

        # one C++ call per product (reshape, allocation, dtype; up to 4 rows on the spin pool's threads)
        self._forward = functools.partial(
            _gemm.forward, packed=self.panels, bias=self.bias, out_features=self.out_features
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


def cpu_gemm_available() -> bool:
    from engine_attention_cpu import _gemm

    return bool(_gemm.available())
