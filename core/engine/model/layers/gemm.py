"""Matrix products, and bfloat16 / float16 models on CPUs that lack native 16-bit GEMMs.

Without AVX-512-BF16 / AMX, torch's bfloat16 matmul falls back to a scalar loop (about 17 GFLOP/s on
an AVX2 machine, against 140 in float32). There the linear weights are kept in float32 (their values
are the checkpoint's bfloat16 values, exactly) and each product runs as a float32 GEMM on the bfloat16
activations, rounded back to bfloat16: the result of a bfloat16 GEMM with float32 accumulation.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.interfaces.layer_kernels import LayerKernels

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           packed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in the weight's dtype, returned in the activation's dtype; through
    ``packed`` (the same product on a packed weight, from ``LayerKernels.pack_linear``) when the
    loader made one."""
    if packed is not None:
        return packed(x)
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


def _linear_layers(model: nn.Module) -> list[nn.Module]:
    from engine.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear))]


def widen_gemm_weights(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """On a CPU without native ``dtype`` GEMMs, keep every linear weight in float32; True if it did."""
    if device.type != "cpu" or dtype not in _HALF or cpu_has_half_gemm(dtype):
        return False
    for module in _linear_layers(model):
        module.weight.data = module.weight.data.float()
    name = str(dtype).replace("torch.", "")
    logger.info("this CPU (%s) has no native %s GEMM: linear weights are kept in float32 and products round "
                "to %s (a %s GEMM with float32 accumulation)", torch.backends.cpu.get_cpu_capability(), name, name, name)
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


def pack_gemm_weights(model: nn.Module, kernels: "LayerKernels", widened: bool = False) -> int:
    """Give every linear layer (``module.packed``) and the LM head (``model.logits_gemm``) the product
    ``kernels.pack_linear`` prepares for its weight; returns how many products were packed.

    The plain weights stay (inspection and the parameter count read them; new weights need packing
    again). Weights a kernel set does not pack (16-bit weights on CPUs with native 16-bit GEMMs, GPU
    weights) keep the plain products. ``widened``: the linear weights were widened to float32, so the
    LM head (often the embedding table, which stays in the model dtype) is packed in float32 too.
    """
    from engine.model.layers.linear import RowParallelLinear

    packed = 0
    for module in _linear_layers(model):  # a row-parallel bias is added after the all-reduce, not in the product
        module.packed = kernels.pack_linear(module.weight, None if isinstance(module, RowParallelLinear) else module.bias)
        packed += module.packed is not None
    head = getattr(model, "lm_head", None) if hasattr(model, "logits_gemm") else None
    if head is not None:
        model.logits_gemm = kernels.pack_linear(head.weight.float() if widened else head.weight)
        packed += model.logits_gemm is not None
    return packed
