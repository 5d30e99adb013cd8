"""The ``cpu`` layer kernels' linear products: float32 weights packed once into 16-column panels for
the register-tile GEMM of ``csrc/gemm.cpp``, in two ISA variants over the same panels: ``avx2`` (a 6x16 tile) and
``avx512`` (a 12x32 tile, 512-bit lanes). Both give the same bits: each output element is one fused multiply-add
chain over k in the same order, so a row's result depends neither on the batch nor on the ISA.

On a 2-core AVX2 machine the ``avx2`` variant runs SmolLM2's shapes at 120-172 GFLOP/s from 16 rows up, against
69-151 for oneDNN's packed product (``python scripts/bench_cpu_gemm.py``); ``engine bench kernels`` measures both
variants where the CPU runs them.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

PANEL = 16  # output columns per packed panel (two AVX2 vectors, one AVX-512 vector)


def gemm_variants(emulated: bool = False) -> dict[str, bool]:
    """Every ISA variant of the GEMM and whether this CPU runs it (``emulated``: in the SIMDe build, for tests)."""
    return dict(_ops(emulated).variants())


def _ops(emulated: bool = False):
    if emulated:
        from engine_attention_cpu import _gemm_emulated

        return _gemm_emulated
    from engine_attention_cpu import _gemm

    return _gemm


class CpuPackedLinear:
    """``x @ weight.T + bias`` on the weight packed as ``[ceil(N/16), K, 16]`` float32 panels;
    computes in float32 and returns x's dtype (so bfloat16 activations get a bfloat16 GEMM with
    float32 accumulation). ``variant``: the ISA variant (``gemm_variants()``), None for the widest this CPU has;
    ``emulated``: the SIMDe build's kernels, for tests of a variant this CPU lacks."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        variant: Optional[str] = None,
        emulated: bool = False,
    ):
        _gemm = _ops(emulated)
        runnable = gemm_variants(emulated)
        names = list(runnable)
        if variant is not None and not runnable.get(variant, False):
            raise RuntimeError(f"GEMM variant {variant!r} cannot run on this CPU (variants: {names})")
        self.variant_id = names.index(variant) if variant is not None else int(_gemm.default_variant())
        self.variant = names[self.variant_id]
        self.out_features, self.in_features = weight.shape
        self.panels = _gemm.pack_weight(weight.detach().float())
        self.bias = None
        if bias is not None:  # padded to the panels, so the kernel's last tile reads no further than its own
            self.bias = torch.zeros(self.panels.shape[0] * PANEL)
            self.bias[: self.out_features] = bias.detach().float()

        # one C++ call per product (reshape, allocation, dtype; up to 4 rows on the spin pool's threads)
        self._forward = functools.partial(
            _gemm.forward, packed=self.panels, bias=self.bias, out_features=self.out_features, variant=self.variant_id
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


def cpu_gemm_available() -> bool:
    from engine_attention_cpu import _gemm

    return bool(_gemm.available())
