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
    logits = getattr(model, "lm_head", None)
    if logits is not None:  # tied or not, the LM head gets its own float32 copy; the embedding stays as is
        model.logits_weight = logits.weight.detach().float()
    logger.info("this CPU (%s) has no native %s GEMM: linear weights are kept in float32 and products round "
                "to %s (a %s GEMM with float32 accumulation)", torch.backends.cpu.get_cpu_capability(),
                str(dtype).replace("torch.", ""), *(str(dtype).replace("torch.", ""),) * 2)
    return True
