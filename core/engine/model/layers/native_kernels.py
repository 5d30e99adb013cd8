"""The built-in ``native`` LayerKernels: torch ops, the reference every fused implementation matches."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

from engine.hookspecs import hookimpl
from engine.interfaces.layer_kernels import LayerKernels
from engine.model.layers.gemm import native_product_candidates, onednn_packed_linear, widen_gemm_weights
from engine.model.layers.packing import pack_linear_layers, pack_moe_layers, quantized_product
from engine.model.layers.product_choice import (
    ROW_BUCKETS,
    ProductCandidate,
    ProductTable,
    bucketed_product,
    choose_products,
    log_table,
    model_shapes,
    quantized_formats,
)


class NativeLayerKernels(LayerKernels):
    """Torch ops on any device; ``auto`` picks it when no device plugin offers fused kernels."""

    name = "native"
    priority = 0
    batch_invariant_unsupported_reason: ClassVar[Optional[str]] = (
        "torch's products (oneDNN, MKL) sum in an order that depends on the row count; the cpu layer kernels' "
        "GEMM does not"
    )

    def __init__(self):
        # the last step's (positions, cos table, cos rows, sin rows): gathered once per forward, not per layer
        self._rope_rows: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.kernel_cache = True
        self.batch_invariant = False  # every product on one row-invariant kernel (model.batch_invariant)
        self.product_table: Optional[ProductTable] = None
        self._candidates: dict[str, ProductCandidate] = {}
        self.quantized_tables: dict[str, ProductTable] = {}  # format -> the products chosen for its weights
        self._quantized_candidates: dict[str, dict[str, ProductCandidate]] = {}

    def configure(self, vllm_config) -> None:
        self.kernel_cache = vllm_config.device.kernel_cache
        self.batch_invariant = vllm_config.model.batch_invariant

    def process_weights_after_loading(self, model, dtype, device):
        """CPU policy: on a CPU without native ``dtype`` GEMMs the linear weights are kept in float32; then the
        candidate products (``product_candidates``) are timed on the model's weight shapes (or the timing is read
        from the disk cache) and every layer gets the fastest per row bucket. Batch-invariant: each layer gets one
        product for every row count, ``fixed_product`` for float weights, the candidate fastest on a decode batch
        (64 rows) for packed ones (kernels that run batch-invariant offer only row-invariant packed products)."""
        widened = widen_gemm_weights(model, dtype, device)
        if device.type == "cpu":
            candidates = self.product_candidates(dtype)
            self._candidates = {c.name: c for c in candidates}
            weight_dtype = torch.float32 if widened else dtype
            shapes = model_shapes(model)
            if shapes and not self.batch_invariant:
                self.product_table = choose_products(
                    shapes, candidates, dtype, weight_dtype, use_cache=self.kernel_cache
                )
                log_table(self.product_table)
            for fmt in quantized_formats(model):
                candidates = self.quantized_product_candidates(fmt)
                self._quantized_candidates[fmt] = {c.name: c for c in candidates}
                if len(candidates) > 1:
                    self.quantized_tables[fmt] = choose_products(
                        model_shapes(model, fmt), candidates, dtype, weight_dtype, self.kernel_cache, weight_format=fmt
                    )
                    log_table(self.quantized_tables[fmt])
        pack_linear_layers(model, self.pack_linear, head_in_float32=widened, pack_quantized=self.pack_quantized)
        pack_moe_layers(model, self.pack_experts, self.pack_quantized_experts)

    def product_candidates(self, dtype: torch.dtype) -> list[ProductCandidate]:
        """The CPU products to choose among by measurement (a plugin adds its own kernels to these)."""
        return native_product_candidates(dtype)

    def quantized_product_candidates(self, weight_format: str) -> list[ProductCandidate]:
        """The products on weights packed in ``weight_format`` to choose among by measurement; ``make`` takes a
        :class:`~engine.model.quant_formats.QuantizedWeight`. Native torch has no kernel for packed blocks: its one
        candidate de-quantizes the weight once, into a float32 product."""
        return [ProductCandidate("dequantized", quantized_product)]

    def pack_quantized(self, weight, bias=None):
        """The product measured fastest for this packed weight's format and shape (per row bucket), or the first
        candidate where nothing was measured."""
        candidates = self._quantized_candidates.get(weight.format)
        if candidates is None:
            candidates = {c.name: c for c in self.quantized_product_candidates(weight.format)}
        table = self.quantized_tables.get(weight.format)
        if table is not None:
            key = "x".join(map(str, weight.shape))
            choice = table.choices.get(key) or table.choices.get(key + " head")
            if choice is not None and self.batch_invariant:  # one product for every row count: the decode batch's
                return candidates[choice.chosen[ROW_BUCKETS[1].name]].make(weight, bias)
            if choice is not None:
                return bucketed_product(choice, candidates, weight, bias)
        return next(iter(candidates.values())).make(weight, bias)

    def pack_linear(self, weight, bias=None):
        """The product measured fastest for this weight's shape (per row bucket); without a measurement (a
        weight packed outside ``process_weights_after_loading``), ``fixed_product``."""
        table = self.product_table
        if table is not None and weight.dim() == 2 and weight.device.type == "cpu":
            key = "x".join(map(str, weight.shape))
            choice = table.choices.get(key) or table.choices.get(key + " head")
            if choice is not None:
                return bucketed_product(choice, self._candidates, weight, bias)
        return self.fixed_product(weight, bias)

    def fixed_product(self, weight, bias=None):
        """oneDNN's packed float32 product on CPUs (:class:`~engine.model.layers.gemm.PackedLinear`); kernels that
        run batch-invariant return a row-invariant product here for every float weight."""
        return onednn_packed_linear(weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # one call, the same three steps as below
            return F.rms_norm(x, weight.shape, weight, eps)
        dtype = x.dtype
        x32 = x.to(
            torch.promote_types(dtype, torch.float32)
        )  # at least float32 (float64 stays: the oracle's reference)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_embedding(self, positions, query, key, cos, sin, head_size):
        last = self._rope_rows  # one read and one write: engines in other threads never see half an update
        if last is None or last[0] is not positions or last[1] is not cos:
            last = (
                positions,
                cos,
                cos.index_select(0, positions).unsqueeze(1),
                sin.index_select(0, positions).unsqueeze(1),
            )
            self._rope_rows = last
        cos, sin = last[2], last[3]
        return _rotate(query, cos, sin, head_size), _rotate(key, cos, sin, head_size)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    tokens, rotary_dim = x.shape[0], cos.shape[-1]
    x = x.view(tokens, -1, head_size)
    rot = x[..., :rotary_dim]
    half = rotary_dim // 2
    swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + swapped * sin  # two products and a sum, rounded as the reference rounds them
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if rotary_dim < head_size:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out.reshape(tokens, -1)


@hookimpl
def engine_layer_kernels():
    return [NativeLayerKernels]
