"""Packing a loaded model's products: every linear layer and the LM head get the product the layer kernels
prepare for their weights (quantized weights through ``pack_quantized``), every MoE layer its experts' products."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from engine.model.layers.gemm import PlainProduct, onednn_packed_linear
from engine.model.layers.linear import PackedProduct, RowParallelLinear, linear_layers
from engine.model.quant_formats import QuantizedExperts, QuantizedWeight, dequantize

if TYPE_CHECKING:
    from engine.interfaces.moe import ExpertsProduct


def quantized_product(weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> PackedProduct:
    """The product on a packed weight when the layer kernels offer none: the weight de-quantized once into a
    float32 product (:func:`~engine.model.layers.gemm.onednn_packed_linear`, else ``F.linear``)."""
    dense = dequantize(weight)
    return onednn_packed_linear(dense, bias) or PlainProduct(dense, bias, torch.float32)


def pack_linear_layers(
    model: Any,
    pack_linear: Callable[..., Optional[PackedProduct]],
    head_in_float32: bool = False,
    pack_quantized: Callable[..., PackedProduct] = quantized_product,
) -> int:
    """Give every linear layer (``module.packed``) and the LM head (``model.logits_gemm``) the product
    ``pack_linear(weight, bias)`` prepares for its weight (``pack_quantized(quant_weight, bias)`` for a quantized
    one); returns how many products were packed.

    The plain weights stay (inspection and the parameter count read them; new weights need packing
    again). A weight ``pack_linear`` declines (None) keeps the plain product. ``head_in_float32``: pack
    the LM head (often the embedding table, kept in the model dtype) from a float32 copy.
    """
    packed = 0
    for module in linear_layers(model):  # a row-parallel bias is added after the all-reduce, not in the product
        bias = None if isinstance(module, RowParallelLinear) else module.bias
        quant = getattr(module, "quant_weight", None)
        module.packed = pack_linear(module.weight, bias) if quant is None else pack_quantized(quant, bias)
        packed += module.packed is not None
    head = getattr(model, "lm_head", None) if hasattr(model, "logits_gemm") else None
    if head is not None and getattr(head, "quant_weight", None) is not None:
        model.logits_gemm = pack_quantized(head.quant_weight, None)
        packed += 1
    elif head is not None:
        model.logits_gemm = pack_linear(head.weight.float() if head_in_float32 else head.weight)
        packed += model.logits_gemm is not None
    return packed


def pack_moe_layers(
    model: Any,
    pack_experts: Callable[[torch.Tensor, torch.Tensor], Optional[ExpertsProduct]],
    pack_quantized_experts: Optional[Callable[[QuantizedExperts, QuantizedExperts], ExpertsProduct]] = None,
) -> int:
    """Give every MoE layer (``FusedMoE``) the experts' products ``pack_experts(w13, w2)`` prepares (``layer.packed``),
    or ``pack_quantized_experts(quant_w13, quant_w2)`` for a layer whose experts a quantization method packed;
    returns how many layers got one (None keeps the layer kernels' default ``fused_moe``).

    Unlike a linear layer's, a packed MoE layer's plain expert weights are released (emptied, their dtype kept): the
    experts are most of an MoE model, and a second copy of them would double its memory."""
    packed = 0
    layers = [m for m in model.modules() if hasattr(m, "w13_weight") and hasattr(m, "w2_weight")]
    for layer in layers:
        quant_w13, quant_w2 = getattr(layer, "quant_w13", None), getattr(layer, "quant_w2", None)
        if quant_w13 is not None and quant_w2 is not None:
            if pack_quantized_experts is None:
                raise ValueError("the layer kernels cannot run quantized experts (no pack_quantized_experts)")
            layer.packed = pack_quantized_experts(quant_w13, quant_w2)
        else:
            layer.packed = pack_experts(layer.w13_weight.data, layer.w2_weight.data)
        if layer.packed is not None:
            packed += 1
            for param in (layer.w13_weight, layer.w2_weight):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return packed
