"""Matrix products, and bfloat16 / float16 models on CPUs that lack native 16-bit GEMMs.

Without AVX-512-BF16 / AMX, torch's bfloat16 matmul falls back to a scalar loop (about 17 GFLOP/s on
an AVX2 machine, against 140 in float32). There the linear weights are kept in float32 (their values
are the checkpoint's bfloat16 values, exactly) and each product runs as a float32 GEMM on the bfloat16
activations, rounded back to bfloat16: the result of a bfloat16 GEMM with float32 accumulation.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in the weight's dtype, returned in the activation's dtype."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return out.to(x.dtype)


def cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def widen_gemm_weights(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """On a CPU without native ``dtype`` GEMMs, keep every linear weight in float32; True if it did."""
    from engine.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if device.type != "cpu" or dtype not in _HALF or cpu_has_half_gemm(dtype):
        return False
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear)):
            module.weight.data = module.weight.data.float()
    name = str(dtype).replace("torch.", "")
    logger.info("this CPU (%s) has no native %s GEMM: linear weights are kept in float32 and products round "
                "to %s (a %s GEMM with float32 accumulation)", torch.backends.cpu.get_cpu_capability(), name, name, name)
    return True


class PackedLinear:
    """``x @ weight.T`` through oneDNN with the weight packed once into its blocked layout.

    Used for the LM head on CPUs: its products have few rows (one per sampled request), where oneDNN's
    packed kernels run about twice as fast as the plain GEMM. Computes in float32, returns x's dtype.
    """

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), self.packed, None, "none", [], "")
        return out if out.dtype == x.dtype else out.to(x.dtype)


def pack_logits_gemm(model: nn.Module, dtype: torch.dtype, device: torch.device, widened: bool) -> bool:
    """Give the model a packed float32 LM-head product (``model.logits_gemm``) on CPUs; True if it did."""
    head = getattr(model, "lm_head", None)
    if device.type != "cpu" or head is None or not hasattr(model, "logits_gemm"):
        return False
    if not (dtype == torch.float32 or widened) or not torch.backends.mkldnn.is_available():
        return False  # a CPU with native 16-bit GEMMs keeps the model's own dtype
    try:
        model.logits_gemm = PackedLinear(head.weight)
    except RuntimeError as exc:  # a oneDNN build without this primitive: the plain GEMM stays
        logger.info("LM head stays on the plain GEMM: %s", exc)
        return False
    return True
