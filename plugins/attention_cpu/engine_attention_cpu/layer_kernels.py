"""The ``cpu`` LayerKernels: RMSNorm (with its residual add), SiLU-and-multiply and RoPE, each one pass over its rows
in C++ (``csrc/layer_kernels.cpp``) instead of several torch ops, the linear products on weights packed for a
register-tile GEMM in AVX2 and AVX-512 variants (``gemm.py``, ``csrc/gemm.cpp``) where it measures faster than
torch's products on the model's shapes (``engine.model.layers.product_choice``), and the fused mixture-of-experts
operation on experts packed for that GEMM (``moe.py``, ``csrc/fused_moe.cpp``).

Inputs the kernels do not take (another device, float64, odd RoPE sizes, 16-bit weights on a CPU
with native 16-bit GEMMs) go to the native torch ops.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from engine.interfaces.base import SelectionContext
from engine.model.layers.native_kernels import NativeLayerKernels
from engine.model.layers.product_choice import ProductCandidate, module_build
from engine_attention_cpu import mamba
from engine_attention_cpu.decode_graph import capture_decode_step
from engine_attention_cpu.gemm import CpuPackedLinear, cpu_gemm_available, gemm_variants
from engine_attention_cpu.lora import add_lora_kernel, kernel_takes, load_lora_ops
from engine_attention_cpu.moe import (
    NEVER,
    CpuFusedExperts,
    CpuQuantizedExperts,
    lossless_panel_dtype,
    measure_dequant_min_rows,
    measure_onednn_min_rows,
    measure_panel_dtype,
    onednn_dtype,
)
from engine_attention_cpu.quant import DequantizedGemmProduct, QuantDotProduct, variants

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() >= 1 and x.shape[-1] > 0


def _load_mamba_ops():
    """The ``_mamba`` extension, or None where it is not built (Mamba layers then run the torch reference)."""
    if importlib.util.find_spec("engine_attention_cpu._mamba") is None:
        return None
    from engine_attention_cpu import _mamba

    return _mamba


class CpuLayerKernels(NativeLayerKernels):
    """Fused C++ kernels for CPUs; ``auto`` prefers them over ``native`` whenever they are built."""

    name = "cpu"
    priority = 10
    batch_invariant_unsupported_reason = None  # the GEMM and the integer-dot kernels: each row its own sums

    def __init__(self):
        super().__init__()
        from engine_attention_cpu import _layers

        self._ops = _layers
        self._gemm = cpu_gemm_available()
        self._has_moe = importlib.util.find_spec("engine_attention_cpu._moe") is not None
        self._mamba = _load_mamba_ops()
        self._lora = load_lora_ops()
        self._expert_kinds: dict[tuple, int] = {}  # experts' shapes and dtype or format -> rows where the kind switches
        self._panel_dtypes: dict[tuple, torch.dtype] = {}  # experts' shapes and dtypes -> the panels' dtype

    @classmethod
    def unavailable_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        if ctx.device != "cpu":
            reasons.append(f"runs on the CPU only (device is {ctx.device})")
        if ctx.model_info is not None and ctx.model_info.dtype == torch.float64:
            reasons.append("dtype float64 unsupported (float32, bfloat16, float16)")
        if any(importlib.util.find_spec(f"engine_attention_cpu.{ext}") is None for ext in ("_layers", "_gemm")):
            reasons.append("its C++ kernels are not built (pip install --no-build-isolation plugins/attention_cpu)")
        elif ctx.config.model.batch_invariant and not cpu_gemm_available():
            reasons.append("batch_invariant: its GEMM needs AVX2 and FMA, which this CPU lacks")
        elif ctx.config.model.batch_invariant and ctx.config.lora.enable_lora and load_lora_ops() is None:
            reasons.append("batch_invariant with lora.enable_lora: its LoRA kernel (_lora) is not built")
        return reasons

    @classmethod
    def serves_packed_weights(cls) -> bool:
        """With the integer-dot kernels and the GEMM that de-quantizes a panel at a time built: on W1 (32 requests)
        a Q4_1 GGUF kept packed serves 0.88x the float32 weights' tokens/s and decodes one stream 2.5x faster in
        two thirds of the memory (docs/benchmarks.md)."""
        return all(importlib.util.find_spec(f"engine_attention_cpu.{ext}") is not None for ext in ("_quant", "_gemm"))

    def product_candidates(self, dtype):
        """This plugin's GEMM in each ISA variant this CPU runs (the widest listed first: the default; the variants
        give the same bits) beside torch's products; on each shape and row bucket another wins only when it is
        clearly faster (``engine bench kernels``)."""
        candidates = super().product_candidates(dtype)
        if self._gemm:
            runnable = [name for name, ok in gemm_variants().items() if ok]
            build = module_build(importlib.import_module("engine_attention_cpu._gemm"))
            for variant in runnable:  # inserted in front, so the widest ends first
                candidates.insert(
                    0,
                    ProductCandidate(
                        f"cpu-{variant}", lambda w, b, variant=variant: CpuPackedLinear(w, b, variant), build
                    ),
                )
        return candidates

    def quantized_product_candidates(self, weight_format):
        """The integer-dot kernels in every ISA variant this CPU has (the widest first: the default), and the
        per-call de-quantization into the AVX2 GEMM for prompt-sized products; without the built kernels, the
        native candidate."""
        if importlib.util.find_spec("engine_attention_cpu._quant") is None:
            return super().quantized_product_candidates(weight_format)
        runnable = [name for name, ok in variants().items() if ok]
        simd = [name for name in runnable if name != "scalar"] or runnable
        build = module_build(importlib.import_module("engine_attention_cpu._quant"))  # rebuilt kernels: measured again
        candidates = [
            ProductCandidate(
                f"{weight_format}-{variant}", lambda w, b, variant=variant: QuantDotProduct(w, b, variant), build
            )
            for variant in reversed(simd)
        ]
        if self._gemm:
            candidates.append(ProductCandidate(f"{weight_format}-dequant-avx2", DequantizedGemmProduct, build))
        return candidates

    def fixed_product(self, weight, bias=None):
        """The AVX2 GEMM for float32 weights on the CPU (batch-invariant: for 16-bit ones too, widened into its
        panels); oneDNN's product where the CPU lacks AVX2."""
        floats = (torch.float32,) + ((torch.bfloat16, torch.float16) if self.batch_invariant else ())
        if not (self._gemm and weight.device.type == "cpu" and weight.dtype in floats and weight.dim() == 2):
            return super().fixed_product(weight, bias)
        return CpuPackedLinear(weight, bias)

    def pack_experts(self, w13, w2):
        """The experts packed for the C++ fused-MoE operation (``moe.py``), each product's kind (the AVX2 GEMM or
        oneDNN) chosen by its row count from a measurement on the experts' shapes (once per shape); the torch
        reference where the kernels are not built or the weights are not on the CPU."""
        if not (w13.device.type == "cpu" and self._has_moe and w13.shape[0] > 0):
            return super().pack_experts(w13, w2)
        dtype = onednn_dtype(w13.dtype)
        if self.batch_invariant:  # the AVX2 GEMM for every product: a row's sums never depend on the row count
            return CpuFusedExperts(w13, w2, NEVER, dtype)
        key = (tuple(w13.shape[1:]), tuple(w2.shape[1:]), dtype)
        if key not in self._expert_kinds:
            min_rows, timings = measure_onednn_min_rows(w13, w2, dtype, self._gemm)
            self._expert_kinds[key] = min_rows
            logger.info(
                "experts %s / %s: oneDNN (%s) takes products of %s rows, the GEMM's panels the rest "
                "(us per product: %s)",
                "x".join(map(str, w13.shape[1:])),
                "x".join(map(str, w2.shape[1:])),
                str(dtype).replace("torch.", ""),
                "no" if min_rows >= 1 << 62 else f"{min_rows}+",
                timings,
            )
        min_rows = self._expert_kinds[key]
        return CpuFusedExperts(w13, w2, min_rows, dtype, self._panel_dtype(w13, w2, min_rows))

    def _panel_dtype(self, w13: torch.Tensor, w2: torch.Tensor, onednn_min_rows: int) -> torch.dtype:
        """The experts' panel dtype: 16-bit where it holds every weight exactly and a decode-like step measured on the
        first such layer ran clearly faster on it (once per shape and dtypes), else float32."""
        half = lossless_panel_dtype(w13, w2) if onednn_min_rows > 1 and self._gemm else None
        if half is None:
            return torch.float32
        key = ("panels", tuple(w13.shape), tuple(w2.shape), w13.dtype, half, onednn_min_rows)
        if key not in self._panel_dtypes:
            chosen, timings = measure_panel_dtype(w13, w2, half, onednn_min_rows)
            self._panel_dtypes[key] = chosen
            logger.info(
                "experts %s: %s panels (exact for these weights) for the GEMM's products (us per decode-like step of "
                "every expert: %s)",
                "x".join(map(str, w13.shape)),
                str(chosen).replace("torch.", ""),
                timings,
            )
        return self._panel_dtypes[key]

    def pack_quantized_experts(self, w13, w2):
        """Packed quantized experts run in C++ as they are stored (``moe.CpuQuantizedExperts``): the widest integer-dot
        variant this CPU runs for small products, the weights de-quantized into the GEMM's panels from a row count
        measured on the experts' shapes (once per shape and format); the default (de-quantized once, into float)
        where the kernels are not built."""
        if not (self._has_moe and importlib.util.find_spec("engine_attention_cpu._quant") is not None):
            return super().pack_quantized_experts(w13, w2)
        runnable = [name for name, ok in variants().items() if ok]
        variant = runnable[-1]  # the widest: variants() lists them scalar first
        if self.batch_invariant:  # integer dot products for every product, whatever its rows
            return CpuQuantizedExperts(w13, w2, variant, NEVER)
        key = (w13.format, w13.shape[1:], w2.shape[1:], variant)
        if key not in self._expert_kinds:
            min_rows, timings = measure_dequant_min_rows(w13, w2, variant, self._gemm)
            self._expert_kinds[key] = min_rows
            logger.info(
                "%s experts %s / %s: integer dot products (%s) for %s (us per product: %s)",
                w13.format,
                "x".join(map(str, w13.shape[1:])),
                "x".join(map(str, w2.shape[1:])),
                variant,
                "every product" if min_rows >= NEVER else f"fewer than {min_rows} rows, the de-quantized GEMM above",
                timings,
            )
        return CpuQuantizedExperts(w13, w2, variant, self._expert_kinds[key])

    def causal_conv1d(self, x, weight, bias, conv_state, query_start_loc, activation="silu"):
        if self._mamba is None or x.device.type != "cpu":
            return super().causal_conv1d(x, weight, bias, conv_state, query_start_loc, activation)
        return mamba.causal_conv1d(self._mamba, x, weight, bias, conv_state, query_start_loc, activation)

    def mamba2_scan(self, x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, query_start_loc, chunk_size):
        """The recurrence token by token per (request, head) in C++ (the same sums as the chunked form, whose
        products only pay off on matrix units)."""
        if self._mamba is None or x.device.type != "cpu":
            return super().mamba2_scan(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, query_start_loc, chunk_size)
        return mamba.mamba2_scan(self._mamba, x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, query_start_loc)

    def selective_scan(self, x, dt, A, B, C, D, z, dt_bias, ssm_state, query_start_loc):
        if self._mamba is None or x.device.type != "cpu":
            return super().selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, query_start_loc)
        return mamba.selective_scan(self._mamba, x, dt, A, B, C, D, z, dt_bias, ssm_state, query_start_loc)

    def lora_kernel_built(self) -> bool:
        return self._lora is not None

    def add_lora(self, y, x, lora_a, lora_b, mapping, out_slices=None):
        """One C++ call per layer and step (``lora.py``), where it is built and takes the operands."""
        if self._lora is not None and kernel_takes(y, x, lora_a, lora_b):
            return add_lora_kernel(self._lora, y, x, lora_a, lora_b, mapping, out_slices)
        return super().add_lora(y, x, lora_a, lora_b, mapping, out_slices)

    def capture_decode_step(self, model, attention_layers):
        """The decoder-layer loop of a Llama-shaped model replayed in C++ for pure decode steps (``decode_graph``)."""
        return capture_decode_step(self, model, attention_layers)

    def rms_norm(self, x, weight, eps):
        if not _cpu_rows(x):
            return super().rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._ops.rms_norm(out, rows, weight.float().contiguous(), float(eps))
        return out.view(x.shape)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        if not (_cpu_rows(x) and x.shape == residual.shape and x.dtype == residual.dtype):
            return super().fused_add_rms_norm(x, residual, weight, eps)
        x, residual = x.contiguous(), residual.contiguous()
        self._ops.fused_add_rms_norm(
            x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]), weight.float().contiguous(), float(eps)
        )
        return x, residual

    def silu_and_mul(self, x):
        if not (_cpu_rows(x) and x.shape[-1] % 2 == 0):
            return super().silu_and_mul(x)
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=x.dtype)
        self._ops.silu_and_mul(out, rows)
        return out.view(*x.shape[:-1], x.shape[-1] // 2)

    def rotary_embedding(self, positions, query, key, cos, sin, head_size):
        fits = (
            _cpu_rows(query)
            and query.dtype == key.dtype
            and query.dim() == 2
            and key.dim() == 2
            and query.stride(-1) == 1
            and key.stride(-1) == 1
            and cos.device.type == "cpu"
        )
        if not fits:
            return super().rotary_embedding(positions, query, key, cos, sin, head_size)
        self._ops.rotary_embedding(positions.to(torch.int64).contiguous(), query, key, cos, sin, head_size)
        return query, key
