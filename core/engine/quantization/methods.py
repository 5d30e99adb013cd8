"""The built-in quantization methods: ``none`` (float weights), ``gguf`` (GGUF blocks kept packed) and ``int8``
(weight-only int8 with per-channel scales, made at load from any float model)."""

from __future__ import annotations

import logging

import torch

from engine.hookspecs import hookimpl
from engine.interfaces.base import SelectionContext
from engine.interfaces.layer_kernels import LayerKernels
from engine.interfaces.quantization import QuantizationMethod
from engine.model.layers.linear import finish_quantized_weight, linear_layers, set_quantized_weight
from engine.model.layers.moe import moe_layers
from engine.model.quant_formats import GGUF_TYPES, QuantizedExperts, quantize

logger = logging.getLogger(__name__)


def _log_quantized(model: torch.nn.Module, method: str) -> None:
    packed = [w for m in model.modules() if (w := getattr(m, "quant_weight", None)) is not None]
    experts = [w for m in moe_layers(model) for w in (m.quant_w13, m.quant_w2) if w is not None]
    if packed or experts:
        formats = sorted({w.format for w in packed + experts})
        logger.info(
            "%s: %d weights and the experts of %d MoE layers kept packed (%s), %.1f MiB",
            method,
            len(packed),
            len(experts) // 2,
            ", ".join(formats),
            sum(w.nbytes for w in packed + experts) / 2**20,
        )


def _layer_kernels(ctx: SelectionContext) -> type[LayerKernels]:
    """The layer kernels the configuration chooses (as the worker will: same choice, same context)."""
    from engine.hookspecs import KINDS
    from engine.plugins import get_plugin_manager

    name = ctx.config.get_key(KINDS["layer_kernels"].config_key or "device.layer_kernels")
    return get_plugin_manager().select("layer_kernels", name, ctx).cls


def quantize_experts(model: torch.nn.Module, fmt: str) -> None:
    """Quantize every MoE layer's experts into ``fmt``, expert by expert (``FusedMoE.set_quantized_experts``)."""
    for layer in moe_layers(model):
        if layer.quant_w13 is not None:
            continue
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        layer.set_quantized_experts(
            QuantizedExperts.stack([quantize(w, fmt) for w in w13]),
            QuantizedExperts.stack([quantize(w, fmt) for w in w2]),
        )


class NoQuantization(QuantizationMethod):
    """Float weights in the model dtype (a quantized checkpoint is de-quantized as it loads)."""

    name = "none"
    priority = 0


class GGUFQuantization(QuantizationMethod):
    """A GGUF file's Q4_0, Q4_1 and Q8_0 tensors stay packed in memory, blocks as llama.cpp stores them; other
    tensor types (F32 norms, K-quants) are de-quantized as they load. ``auto`` takes it for a GGUF file where the
    chosen layer kernels serve packed weights well (``LayerKernels.serves_packed_weights``: the ``cpu`` kernels),
    else keeps float weights (``native`` would de-quantize every product)."""

    name = "gguf"
    priority = 10

    @classmethod
    def unavailable_reasons(cls, ctx: SelectionContext) -> list[str]:
        info = ctx.model_info
        if info is not None and info.format != "gguf":
            return [f"the model is not a GGUF file ({info.path})"]
        return []

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        return (
            ctx.model_info is not None
            and ctx.model_info.format == "gguf"
            and _layer_kernels(ctx).serves_packed_weights()
        )

    def packed_checkpoint_formats(self, model_info) -> frozenset[str]:
        return frozenset(GGUF_TYPES.values())

    def process_weights_after_loading(self, model):
        for layer in moe_layers(model):
            layer.finish_quantized_experts()
        for module in model.modules():
            if "_quant_shards" in module.__dict__:
                finish_quantized_weight(module)
        _log_quantized(model, "gguf")


class Int8Quantization(QuantizationMethod):
    """Weight-only int8: every linear weight, the LM head and the MoE experts quantized at load, one float32 scale per
    output channel (absmax / 127); activations are quantized per block of 32 inside the products. Routers stay in
    float. Never chosen by ``auto``."""

    name = "int8"
    priority = 5

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        return False

    def process_weights_after_loading(self, model):
        for module in linear_layers(model, quantized=False):
            if getattr(module, "keep_float", False):
                continue  # MoE routers: a token's experts must not change with the weights' rounding
            set_quantized_weight(module, quantize(module.weight.data, "int8"))
        head = getattr(model, "lm_head", None) if hasattr(model, "logits_gemm") else None
        if head is not None and getattr(head, "quant_weight", None) is None:
            set_quantized_weight(head, quantize(head.weight.data, "int8"))
        quantize_experts(model, "int8")
        _log_quantized(model, "int8")


@hookimpl
def engine_quantization_methods():
    return [NoQuantization, GGUFQuantization, Int8Quantization]
