"""The ``cpu`` layer kernels' fused mixture-of-experts operation: one C++ call per MoE layer and step
(``csrc/fused_moe.cpp``) that groups the tokens by expert and runs each expert's rows as one product.

An expert's product is this plugin's GEMM (its widest ISA variant) on 16-column panels or oneDNN's packed product
(float32, or the model's 16-bit dtype on CPUs with native 16-bit GEMMs), chosen by row count: both are timed once on
the experts' shapes at the row counts experts see (a few rows per expert in decode steps, hundreds in prompt
chunks), and oneDNN takes the products from the smallest row count where it is clearly faster on both shapes. Only
the weights a chosen kind reads are kept.

The panels hold float32, or a 16-bit dtype that holds every expert weight exactly (a bfloat16 model's own; a float32
model's loaded from a bfloat16 checkpoint): widened as they are read, 16-bit panels give the float32 panels' bits
and read half the bytes. A decode step reads every active expert's whole weight for a few rows each, so which is
faster is timed on that: one layer's experts, all active, from memory (``measure_panel_dtype``).

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


def lossless_panel_dtype(w13: torch.Tensor, w2: torch.Tensor) -> Optional[torch.dtype]:
    """The 16-bit dtype that holds every expert weight exactly: the weights' own if they are 16-bit, else bfloat16 or
    float16 where every float32 weight round-trips through it (a 16-bit checkpoint loaded as float32); None if
    neither does."""
    if w13.dtype in (torch.bfloat16, torch.float16) and w2.dtype == w13.dtype:
        return w13.dtype
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(w.detach().to(dtype).to(w.dtype), w.detach()) for w in (w13, w2)):
            return dtype
    return None


def decode_routing(num_experts: int, rows_per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) of a decode-like step: every expert active with ``rows_per_expert`` rows."""
    ids = torch.arange(num_experts).repeat(rows_per_expert).unsqueeze(1)
    return torch.ones(ids.shape, dtype=torch.float32), ids


def measure_panel_dtype(
    w13: torch.Tensor, w2: torch.Tensor, half_dtype: torch.dtype, onednn_min_rows: int
) -> tuple[torch.dtype, dict]:
    """float32 or ``half_dtype`` panels for the experts' products below ``onednn_min_rows`` rows: each timed on a
    decode-like step of this layer's experts (every expert active with 4 rows, or 1 if oneDNN takes 4; the weights
    come from memory, as in a decode step), the 16-bit panels kept where they are clearly faster; with the timings
    (us per step)."""
    rows = 4 if onednn_min_rows > 4 else 1
    topk_weights, topk_ids = decode_routing(w13.shape[0], rows)
    x = torch.randn(topk_ids.shape[0], w2.shape[1], generator=torch.Generator().manual_seed(0)).to(w13.dtype)
    products: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for dtype in (torch.float32, half_dtype):
        experts = CpuFusedExperts(w13, w2, NEVER, torch.float32, panel_dtype=dtype)

        def step(x: torch.Tensor, experts: CpuFusedExperts = experts) -> torch.Tensor:
            return experts(x, topk_weights, topk_ids)

        products[str(dtype).replace("torch.", "")] = step
    seconds = time_candidates(products, x)
    timings = {name: round(s * 1e6, 1) for name, s in seconds.items()}
    half = str(half_dtype).replace("torch.", "")
    return (half_dtype if seconds[half] * (1 + SWITCH_MARGIN) < seconds["float32"] else torch.float32), timings


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


def _moe_ops(emulated: bool = False):
    """The fused-MoE extension: the native build, or the SIMDe one (tests of code this CPU lacks)."""
    return importlib.import_module("engine_attention_cpu._moe_emulated" if emulated else "engine_attention_cpu._moe")


class CpuFusedExperts:
    """``(x, topk_weights, topk_ids, expert_map) -> [T, hidden]`` on the experts packed for the kinds chosen, in
    float32 accumulation (a bfloat16 model's expert outputs are summed in float32), returned in x's dtype.
    ``panel_dtype``: the panels' element type (a 16-bit one must hold every weight exactly: ``lossless_panel_dtype``);
    ``emulated``: the SIMDe build, whose small products run the AVX-512 code (tests on CPUs without it)."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        onednn_min_rows: int,
        dtype: torch.dtype,
        panel_dtype: torch.dtype = torch.float32,
        emulated: bool = False,
    ):
        from engine_attention_cpu import _gemm

        self._moe = _moe_ops(emulated)
        self.num_experts, self.hidden_size, self.intermediate_size = w2.shape
        self.onednn_min_rows = onednn_min_rows
        self.panel_dtype = panel_dtype
        self.w13: Optional[torch.Tensor] = None
        self.w2: Optional[torch.Tensor] = None
        if onednn_min_rows > 1:  # the panels take the smaller products

            def pack(weights: torch.Tensor) -> torch.Tensor:
                return torch.stack([_gemm.pack_weight(w.detach().float()).to(panel_dtype) for w in weights])

            self.w13, self.w2 = pack(w13), pack(w2)
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
        self._moe = _moe_ops(emulated)
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
