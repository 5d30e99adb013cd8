"""CPU GEMM policy for the layer-kernels plugins: oneDNN's packed float32 product, and bfloat16 /
float16 models on CPUs that lack native 16-bit GEMMs.

Without AVX-512-BF16 / AMX, torch's bfloat16 matmul falls back to a scalar loop (about 17 GFLOP/s on
an AVX2 machine, against 140 in float32). There the linear weights are kept in float32 (their values
are the checkpoint's bfloat16 values, exactly) and each product runs as a float32 GEMM on the bfloat16
activations, rounded back to bfloat16: the result of a bfloat16 GEMM with float32 accumulation.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from engine.model.layers.linear import linear_layers
from engine.model.layers.product_choice import ProductCandidate

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)


def cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def widen_gemm_weights(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """On a CPU without native ``dtype`` GEMMs, keep every linear weight in float32; True if it did."""
    if device.type != "cpu" or dtype not in _HALF or cpu_has_half_gemm(dtype):
        return False
    for module in linear_layers(model):
        module.weight.data = module.weight.data.float()
    name = str(dtype).replace("torch.", "")
    logger.info(
        "this CPU (%s) has no native %s GEMM: linear weights are kept in float32 and products round "
        "to %s (a %s GEMM with float32 accumulation)",
        torch.backends.cpu.get_cpu_capability(),
        name,
        name,
        name,
    )
    return True


class PackedLinear:
    """``x @ weight.T + bias`` through oneDNN, with the weight reordered once into its blocked layout.

    On CPUs oneDNN's packed float32 kernels beat the plain (MKL) GEMM at the row counts of decode
    steps (about 1.5x at 8-16 rows, 1.1x at 64) and match it on prompt-sized products, because the
    weight is not re-packed on every call. Computes in float32, returns x's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), self.packed, self.bias, "none", [], "")
        return out if out.dtype == x.dtype else out.to(x.dtype)


def onednn_packed_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[PackedLinear]:
    """A :class:`PackedLinear` for a float32 weight on the CPU; None (the plain product) for other
    weights, or where this torch's oneDNN lacks the packed primitive."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedLinear(weight, bias)
    except RuntimeError as exc:
        logger.info("linear layers stay on the plain GEMM: %s", exc)
        return None


class PlainProduct:
    """``F.linear`` with the weight in ``dtype`` (MKL's float32 GEMM, or oneDNN's native 16-bit one), returning
    x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        self.weight = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(
            x if x.dtype == self.weight.dtype else x.to(self.weight.dtype), self.weight, self.bias
        )
        return out if out.dtype == x.dtype else out.to(x.dtype)


class PackedHalfLinear:
    """oneDNN's native 16-bit product on a weight reordered once (CPUs with AVX-512-BF16 / AMX / AVX-512-FP16),
    float32 accumulation, returning x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        self.dtype = dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous())
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype).contiguous(), self.packed, self.bias, "none", [], "")
        return out if out.dtype == x.dtype else out.to(x.dtype)


def native_product_candidates(dtype: torch.dtype) -> list[ProductCandidate]:
    """The products torch offers on this CPU for a model in ``dtype``: oneDNN's packed float32 product (first:
    the default that the others must clearly beat), MKL's plain one, and, where the CPU computes 16-bit
    products natively, oneDNN's packed and plain 16-bit ones."""
    candidates = [
        ProductCandidate("onednn", lambda w, b: PackedLinear(w, b) if torch.backends.mkldnn.is_available() else None),
        ProductCandidate("torch", lambda w, b: PlainProduct(w, b, torch.float32)),
    ]
    if dtype in _HALF and cpu_has_half_gemm(dtype):
        name = str(dtype).replace("torch.", "")
        candidates += [
            ProductCandidate(f"onednn-{name}", lambda w, b: PackedHalfLinear(w, b, dtype)),
            ProductCandidate(f"torch-{name}", lambda w, b: PlainProduct(w, b, dtype)),
        ]
    return candidates
