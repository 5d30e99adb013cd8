"""The ``cpu`` layer kernels' fused mixture-of-experts operation: one C++ call per MoE layer and step
(``csrc/fused_moe.cpp``) that groups the tokens by expert and runs each expert's rows as one product.

An expert's product is this plugin's GEMM (its widest ISA variant) on 16-column float32 panels or oneDNN's packed
product (float32, or the model's 16-bit dtype on CPUs with native 16-bit GEMMs), chosen by row count: both are
timed once on the experts' shapes at the row counts experts see (a few rows per expert in decode steps, hundreds in
prompt chunks), and oneDNN takes the products from the smallest row count where it is clearly faster on both
shapes. Only the weights a chosen kind reads are kept.

Experts a quantization method packed (int8, GGUF Q4/Q8 blocks) stay packed: small products run the integer-dot
kernels of ``quant.py`` on them, large ones de-quantize each expert's weight into the GEMM's panels on each call, from
a row count measured the same way.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable, Optional

import torch

from engine.model.layers.gemm import PackedHalfLinear, PackedLinear, cpu_has_half_gemm
from engine.model.layers.product_choice import SWITCH_MARGIN, time_candidates
from engine.model.quant_formats import QuantizedExperts
from engine_attention_cpu.quant import (
    FORMAT_IDS,
    DequantizedGemmProduct,
    QuantDotProduct,
    unsupported_variant_reason,
    variants,
)

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 4, 16, 64, 256)  # rows per expert product at which the two kinds are timed
NEVER = 1 << 62  # onednn_min_rows when oneDNN takes no product


def _onednn_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous())


def onednn_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """oneDNN's products run in the model's 16-bit dtype where the CPU has native GEMMs for it, else in float32."""
    if model_dtype in (torch.bfloat16, torch.float16) and cpu_has_half_gemm(model_dtype):
        return model_dtype
    return torch.float32


def _smallest_winning_rows(
    shapes: list[tuple[int, dict[str, Callable[[torch.Tensor], torch.Tensor]]]], challenger: str, incumbent: str
) -> tuple[int, dict]:
    """The smallest of ``ROW_COUNTS`` from which ``challenger`` is clearly faster than ``incumbent`` on every shape
    (``(in_features, {name: product})``) at that and every larger count, NEVER if none; with the timings (us)."""
    generator = torch.Generator().manual_seed(0)
    by_rows: dict[int, bool] = {}
    timings: dict[str, dict[str, float]] = {}
    for k, products in shapes:
        for rows in ROW_COUNTS:
            seconds = time_candidates(products, torch.randn(rows, k, generator=generator))
            timings[f"{k}@{rows}"] = {name: round(s * 1e6, 1) for name, s in seconds.items()}
            won = seconds[challenger] * (1 + SWITCH_MARGIN) < seconds[incumbent]
            by_rows[rows] = by_rows.get(rows, True) and won
    threshold = NEVER
    for rows in reversed(ROW_COUNTS):
        if not by_rows[rows]:
            break
        threshold = rows
    return threshold, timings


def measure_onednn_min_rows(
    w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype, gemm_available: bool
) -> tuple[int, dict]:
    """The smallest measured row count from which oneDNN is clearly faster than the panels on both expert products
    (and stays so at every larger count), with the timings; 0 when the panels cannot run, NEVER when oneDNN never
    wins (or is missing)."""
    if not torch.backends.mkldnn.is_available():
        return NEVER, {}
    if not gemm_available:
        return 0, {}
    from engine_attention_cpu import _gemm

    shapes: list[tuple[int, dict[str, Callable[[torch.Tensor], torch.Tensor]]]] = []
    for weight in (w13[0], w2[0]):
        n = weight.shape[0]
        panels = _gemm.pack_weight(weight.detach().float())
        onednn = PackedLinear(weight, None) if dtype == torch.float32 else PackedHalfLinear(weight, None, dtype)

        def gemm(x: torch.Tensor, panels: torch.Tensor = panels, n: int = n) -> torch.Tensor:
            return _gemm.forward(x, panels, None, n)  # the widest GEMM variant this CPU has, as the experts run

        shapes.append((weight.shape[1], {"cpu-gemm": gemm, "onednn": onednn}))
    return _smallest_winning_rows(shapes, "onednn", "cpu-gemm")


def measure_dequant_min_rows(
    w13: QuantizedExperts, w2: QuantizedExperts, variant: str, gemm_available: bool
) -> tuple[int, dict]:
    """The smallest measured row count from which de-quantizing an expert's weight into the AVX2 GEMM's panels is
    clearly faster than the integer dot products (``variant``) on both expert products, with the timings; NEVER
    when it never is or the GEMM is not built."""
    if not gemm_available:
        return NEVER, {}
    shapes: list[tuple[int, dict[str, Callable[[torch.Tensor], torch.Tensor]]]] = []
    for weights in (w13, w2):
        weight = weights.expert(0)
        products = {
            variant: QuantDotProduct(weight, None, variant, interleave=False),  # the experts' rows of blocks
            "dequant-avx2": DequantizedGemmProduct(weight, None),
        }
        shapes.append((weight.shape[1], products))
    return _smallest_winning_rows(shapes, "dequant-avx2", variant)


class CpuFusedExperts:
    """``(x, topk_weights, topk_ids, expert_map) -> [T, hidden]`` on the experts packed for the kinds chosen, in
    float32 accumulation (a bfloat16 model's expert outputs are summed in float32), returned in x's dtype."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, onednn_min_rows: int, dtype: torch.dtype):
        from engine_attention_cpu import _gemm, _moe

        self._moe = _moe
        self.num_experts, self.hidden_size, self.intermediate_size = w2.shape
        self.onednn_min_rows = onednn_min_rows
        self.w13: Optional[torch.Tensor] = None
        self.w2: Optional[torch.Tensor] = None
        if onednn_min_rows > 1:  # the panels take the smaller products
            self.w13 = torch.stack([_gemm.pack_weight(w.detach().float()) for w in w13])
            self.w2 = torch.stack([_gemm.pack_weight(w.detach().float()) for w in w2])
        self.w13_onednn: list[torch.Tensor] = []
        self.w2_onednn: list[torch.Tensor] = []
        if onednn_min_rows < NEVER:
            self.w13_onednn = [_onednn_weight(w, dtype) for w in w13]
            self.w2_onednn = [_onednn_weight(w, dtype) for w in w2]

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._moe.fused_experts(
            x,
            self.w13,
            self.w2,
            self.w13_onednn,
            self.w2_onednn,
            self.onednn_min_rows,
            topk_weights,
            topk_ids,
            expert_map,
            self.intermediate_size,
        )


class CpuQuantizedExperts:
    """``(x, topk_weights, topk_ids, expert_map) -> [T, hidden]`` on experts kept packed in a quantized format
    (``csrc/fused_moe.cpp``): the integer-dot kernel ``variant`` for products of fewer than ``dequant_min_rows``
    rows, the weight de-quantized into the AVX2 GEMM's panels for larger ones; x's dtype in and out (``emulated``:
    the SIMDe build, for tests of a variant this CPU lacks)."""

    def __init__(
        self,
        w13: QuantizedExperts,
        w2: QuantizedExperts,
        variant: str,
        dequant_min_rows: int,
        emulated: bool = False,
    ) -> None:
        if w13.format != w2.format:
            raise ValueError(f"experts packed in two formats ({w13.format}, {w2.format})")
        reason = unsupported_variant_reason(variant, emulated)
        if reason:
            raise RuntimeError(reason)
        self._moe = importlib.import_module(
            "engine_attention_cpu._moe_emulated" if emulated else "engine_attention_cpu._moe"
        )
        self.w13, self.w2 = w13, w2
        self.format_id = FORMAT_IDS[w13.format]
        self.variant_id = list(variants(emulated)).index(variant)
        self.dequant_min_rows = dequant_min_rows
        self.intermediate_size = w2.shape[2]

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._moe.fused_quant_experts(
            x,
            self.w13.data,
            self.w13.scales,
            self.w2.data,
            self.w2.scales,
            self.format_id,
            self.variant_id,
            self.dequant_min_rows,
            topk_weights,
            topk_ids,
            expert_map,
            self.intermediate_size,
        )
