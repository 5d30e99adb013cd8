"""The ``cpu`` layer kernels' products on packed quantized weights (``csrc/quant_gemm.cpp``).

- ``QuantDotProduct``: integer block dot products on the packed weight (activations quantized per block of 32),
  in each ISA variant this CPU has: the product of single-stream decoding, which reads 4-8x fewer weight bytes
  than a float32 product. The SIMD variants read the weight interleaved by groups of 8 rows (``interleaved``),
  so that one block of x meets 8 rows per instruction and a block's dot ends as one lane per row; where the CPU has
  AVX-512 VNNI, two groups side by side (the paired layout: 16 rows per 512-bit instruction, one stream a pair).
- ``DequantizedGemmProduct``: the weight de-quantized a 16-row panel at a time, in cache, under the float32 GEMM's
  tile: for products with many rows, where the GEMM's arithmetic dominates and the integer dot would be slower.

Which one runs at which row count is measured at load (``engine.model.layers.product_choice``).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch

from engine.huge_pages import in_huge_pages
from engine.model.quant_formats import FORMATS, QuantizedWeight
from engine_attention_cpu.gemm import PANEL

FORMAT_IDS = {name: index for index, name in enumerate(FORMATS)}  # the C++ enum's order


def _ops(emulated: bool = False):
    if emulated:
        from engine_attention_cpu import _quant_emulated

        return _quant_emulated
    from engine_attention_cpu import _quant

    return _quant


def emulation_built() -> bool:
    """Whether the kernels were also built over SIMDe's AVX-512 (``_quant_emulated``, ``_moe_emulated``): done where
    the CPU lacks AVX-512 VNNI, so that the ``avx512vnni`` variant's code is tested there too (slow, exact; tests
    only, never chosen to serve)."""
    return importlib.util.find_spec("engine_attention_cpu._quant_emulated") is not None


def variants(emulated: bool = False) -> dict[str, bool]:
    """Every ISA variant of the integer kernels and whether this CPU runs it (``emulated``: in the SIMDe build)."""
    return dict(_ops(emulated).variants())


def unsupported_variant_reason(variant: str, emulated: bool = False) -> Optional[str]:
    """Why ``variant`` cannot run here (None when it can)."""
    found = variants(emulated)
    if variant not in found:
        return f"no variant '{variant}' (variants: {sorted(found)})"
    if not found[variant]:
        return f"this CPU ({torch.backends.cpu.get_cpu_capability()}) lacks the instructions of '{variant}'"
    return None


INTERLEAVED_ATTRIBUTE = "_cpu_interleaved"  # where a weight keeps its interleaved copies, shared by its products


def paired_layout_default() -> bool:
    """Whether this CPU's products read the paired interleaved layout: where it runs the ``avx512vnni`` variant (which
    reads only that one); AVX2 CPUs keep the groups' layout, which their tiles read fastest."""
    return variants()["avx512vnni"]


def interleaved(weight: QuantizedWeight, paired: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weight's blocks interleaved by groups of 8 rows, or two groups side by side (``paired``; default: as this
    CPU's products read them, ``paired_layout_default``), ``csrc/quant_kernel.inc``, and for int8 its row scales padded
    to the groups or pairs: made once per weight and layout (every product on it shares the copy, beside the rows of
    blocks that the de-quantizing GEMM, the scalar variant and the torch reference read)."""
    if paired is None:
        paired = paired_layout_default()
    copies = getattr(weight, INTERLEAVED_ATTRIBUTE, None)
    if copies is None:
        copies = {}
        setattr(weight, INTERLEAVED_ATTRIBUTE, copies)
    if paired not in copies:
        data = weight.data.contiguous()
        scales = None if weight.scales is None else weight.scales.float().contiguous()
        copy = _ops().interleave(data, scales, FORMAT_IDS[weight.format], weight.shape[1], paired)
        # the step streams it from memory: in huge pages where the worker places weights there (engine.huge_pages)
        copies[paired] = tuple(None if part is None else in_huge_pages(part) for part in copy)
    return copies[paired]


class QuantDotProduct:
    """``x @ W.T + bias`` by integer block dot products on the packed weight; returns x's dtype (``emulated``: the
    SIMDe build's kernels, for tests of a variant this CPU lacks; ``interleave=False``: the SIMD variants too read the
    rows of blocks, as the fused experts do; ``paired``: the interleaved layout avx2 reads, by default this CPU's,
    ``paired_layout_default``; avx512vnni reads the paired one only)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Optional[torch.Tensor],
        variant: str,
        emulated: bool = False,
        interleave: bool = True,
        paired: Optional[bool] = None,
    ) -> None:
        reason = unsupported_variant_reason(variant, emulated)
        if reason:
            raise RuntimeError(reason)
        self.weight = weight
        self.format_id = FORMAT_IDS[weight.format]
        self.variant_id = list(variants(emulated)).index(variant)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        # what the kernel reads: the SIMD variants, the interleaved copy; the scalar one, the rows of blocks
        rows_of_blocks = variant == "scalar" or not interleave
        if variant == "avx512vnni":  # (its emulation too, on a CPU whose own products read the groups' layout)
            if paired is False:
                raise ValueError("the avx512vnni variant reads the paired interleaved layout only")
            paired = True
        self.data, self.scales = (weight.data, weight.scales) if rows_of_blocks else interleaved(weight, paired)
        # one C++ call per product (reshape, allocation and dtype in C++): a decode step makes 120 of them
        self._forward = functools.partial(
            _ops(emulated).forward,
            data=self.data,
            scales=self.scales,
            format=self.format_id,
            variant=self.variant_id,
            bias=self.bias,
            out_features=self.out_features,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


class DequantizedGemmProduct:
    """The float32 GEMM (``gemm.py``'s tile) on the weight de-quantized one 16-row panel at a time into each thread's
    buffer, which stays in cache while every row of x passes it: for products with many rows. Nothing the size of
    the weight is written, and the result is the same bits as de-quantizing it whole, then the packed GEMM."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor]):
        self.weight = weight
        self.format_id = FORMAT_IDS[weight.format]
        self.out_features, self.in_features = weight.shape
        padded_bias = None
        if bias is not None:
            padded_bias = torch.zeros(-(-self.out_features // PANEL) * PANEL)
            padded_bias[: self.out_features] = bias.detach().float()
        self.bias = padded_bias
        self._forward = functools.partial(
            _ops().dequantized_forward,
            data=weight.data,
            scales=weight.scales,
            format=self.format_id,
            bias=padded_bias,
            out_features=self.out_features,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


def row_lookup(weight: QuantizedWeight):
    """``ids [T] int64 -> [T, K] float32``: rows of a quantized table (an embedding's), de-quantized in one C++ call:
    ``engine.model.quant_formats.dequantize``'s bits for those rows, without its dozen torch operations."""
    return functools.partial(
        _ops().dequantize_rows,
        weight.data,
        weight.scales,
        FORMAT_IDS[weight.format],
        weight.shape[1],
    )


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight, de-quantized by the C++ kernel (tests hold it to the torch reference)."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    _ops().dequantize(out, weight.data, weight.scales, FORMAT_IDS[weight.format])
    return out
