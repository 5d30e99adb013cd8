"""Quantized weights: the packed formats against llama.cpp's layout (gguf-py de-quantizes our blocks to our values),
and the ``cpu`` plugin's products on them against de-quantize-then-multiply, for every block type, shape remainder
and ISA variant: those this CPU has natively, the others in the SIMDe build (AVX-512 emulated on AVX2 CPUs; a variant
neither runs skips, naming the missing instructions)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engine.model.quant_formats import (
    BLOCK_BYTES,
    FORMATS,
    QuantizedWeight,
    cat_rows,
    dequantize,
    quantize,
    quantize_activations,
    reference_product,
)

GGUF_FORMATS = ("q4_0", "q4_1", "q8_0")
HAS_QUANT = (
    importlib.util.find_spec("engine_attention_cpu") is not None
    and importlib.util.find_spec("engine_attention_cpu._quant") is not None
)
ALL_VARIANTS = ("scalar", "avx2", "avx512vnni")


def _weight(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.05


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_blocks_are_llama_cpps(fmt):
    """gguf-py (llama.cpp's own Python reader) de-quantizes the blocks we pack to exactly our values, and its
    quantizer's blocks de-quantize through ours to its values: the byte layout is llama.cpp's."""
    gguf = pytest.importorskip("gguf")
    weight = _weight(6, 64)
    packed = quantize(weight, fmt)
    assert packed.data.shape == (6, 64 // 32 * BLOCK_BYTES[fmt]) and packed.data.dtype == torch.uint8
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    theirs = gguf.quants.dequantize(packed.data.numpy(), qtype)
    assert np.array_equal(theirs, dequantize(packed).numpy())
    try:
        their_blocks = gguf.quants.quantize(weight.numpy(), qtype)
    except NotImplementedError:
        pytest.skip(f"this gguf-py cannot quantize {fmt}")
    mine = QuantizedWeight(fmt, (6, 64), torch.from_numpy(np.ascontiguousarray(their_blocks)))
    assert np.allclose(dequantize(mine).numpy(), gguf.quants.dequantize(their_blocks, qtype), atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_error_is_within_the_formats_step(fmt):
    weight = _weight(40, 96)
    error = (dequantize(quantize(weight, fmt)) - weight).abs()
    block_range = weight.reshape(40, 3, 32).abs().amax(-1, keepdim=True).expand(40, 3, 32).reshape(40, 96)
    # half a step of the format's grid (q4_0: a whole step, its largest value is clipped to 7 of 8 steps)
    error_in_steps = {"q4_0": 1 / 8, "q4_1": 1 / 15, "q8_0": 0.5 / 127, "int8": 0.5 / 127}[fmt]
    row_range = weight.abs().amax(1, keepdim=True)
    allowed = (row_range if fmt == "int8" else block_range) * error_in_steps * 1.01 + 1e-4
    assert (error <= allowed).all()


def test_narrow_and_stack_follow_rows_and_whole_blocks():
    weight = _weight(10, 96)
    for fmt in FORMATS:
        packed = quantize(weight, fmt)
        dense = dequantize(packed)
        assert torch.equal(dequantize(packed.narrow(0, 3, 4)), dense[3:7])
        assert torch.equal(dequantize(packed.narrow(1, 32, 64)), dense[:, 32:96])
        assert torch.equal(
            dequantize(cat_rows([packed.narrow(0, 0, 2), packed.narrow(0, 5, 5)])), torch.cat([dense[:2], dense[5:]])
        )
        assert torch.equal(dequantize(packed.index_rows(torch.tensor([9, 0, 4]))), dense[[9, 0, 4]])
        if fmt != "int8":
            with pytest.raises(ValueError, match="whole blocks"):
                packed.narrow(1, 16, 32)


def test_int8_takes_widths_that_are_not_whole_blocks():
    weight = _weight(7, 40)
    packed = quantize(weight, "int8")
    assert packed.data.shape == (7, 64) and packed.scales.shape == (7,)
    assert (dequantize(packed) - weight).abs().max() <= weight.abs().max() / 127


def test_reference_product_is_dequantize_then_multiply():
    packed = quantize(_weight(12, 64), "q4_1")
    x, bias = torch.randn(3, 64), torch.randn(12)
    assert torch.allclose(reference_product(packed, bias)(x), x @ dequantize(packed).T + bias, atol=1e-6)
    assert reference_product(packed)(x.bfloat16()).dtype == torch.bfloat16


# ---- the cpu plugin's kernels -------------------------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not HAS_QUANT, reason="the cpu plugin's quantized kernels are not built")


def _variant_or_skip(variant):
    """Whether ``variant`` runs in the SIMDe build (the CPU lacks it); skips where neither build runs it."""
    from engine_attention_cpu.quant import emulation_built, unsupported_variant_reason

    reason = unsupported_variant_reason(variant)
    if reason is None:
        return False
    if emulation_built() and unsupported_variant_reason(variant, emulated=True) is None:
        return True
    pytest.skip(f"{reason}, and the kernels were not built over SIMDe")


SHAPES = [(1, 1, 32), (1, 37, 64), (3, 16, 96), (4, 100, 576), (5, 129, 160), (9, 64, 1536)]


@needs_kernels
@pytest.mark.parametrize("variant", ALL_VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_dot_equals_dequantize_then_multiply(fmt, variant):
    """Exactly the reference on the activations as the kernel quantizes them (float rounding only), and within the
    activations' int8 step of the plain float product; rows past a tile of 4, columns of any count, bias."""
    from engine_attention_cpu.quant import QuantDotProduct

    emulated = _variant_or_skip(variant)
    for rows, cols, k in SHAPES + ([(2, 33, 40), (6, 8, 70)] if fmt == "int8" else []):
        weight = quantize(_weight(cols, k, seed=rows), fmt)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
        bias = torch.randn(cols)
        out = QuantDotProduct(weight, bias, variant, emulated)(x)
        dense = dequantize(weight).double()
        exact = quantize_activations(x).double() @ dense.T + bias.double()
        scale = quantize_activations(x).double().abs() @ dense.abs().T + bias.double().abs()
        assert ((out.double() - exact).abs() <= scale * 4e-6 + 1e-6).all(), (fmt, variant, rows, cols, k)
        plain = x.double() @ dense.T + bias.double()
        step = x.abs().amax().item() / 127  # the activations' largest rounding
        assert ((out.double() - plain).abs() <= step * dense.abs().sum(1) + 1e-5).all()


@needs_kernels
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_activations_round_half_away_from_zero_at_every_tie(variant):
    """The kernels quantize x per block of 32 as llama.cpp does (C's roundf: halves away from zero), whole blocks
    in vector code: with the block's largest magnitude 127 its scale is 1, so each x lands on the integer grid
    as given, and a one-hot weight reads each rounded value back (a tie rounded to even, or 0.49999997 rounded
    up as x + 0.5 would, is off by one)."""
    from engine_attention_cpu.quant import QuantDotProduct

    emulated = _variant_or_skip(variant)
    values = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.49999997, -0.49999997, 2.4999998, -3.5000002]
    values += [0.0, -0.0, 1e-8, 7.25, -7.75, 64.5, -65.5, 100.0, 3.5, -4.5, 5.5, -6.5, 8.5, -9.5, 10.5, -11.5]
    values += [12.5, -13.5, 14.5, -127.0]  # 32 values, the largest magnitude 127
    x = torch.tensor([values, [-v for v in values]], dtype=torch.float32)
    assert x.shape == (2, 32)
    weight = quantize(torch.eye(32), "q8_0")  # each row one-hot: out[:, n] = x's rounded n-th value (scaled)
    out = QuantDotProduct(weight, None, variant, emulated)(x).double()
    rounded = torch.sign(x.double()) * torch.floor(x.double().abs() + 0.5)  # exact in float64
    expected = rounded @ dequantize(weight).double().T
    assert torch.allclose(out, expected, rtol=1e-6, atol=0), (out - expected).abs().max()


@needs_kernels
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_variants_agree_and_rows_do_not_depend_on_their_batch(variant):
    from engine_attention_cpu.quant import QuantDotProduct

    emulated = _variant_or_skip(variant)
    weight = quantize(_weight(70, 256), "q4_1")
    x = torch.randn(7, 256)
    product = QuantDotProduct(weight, None, variant, emulated)
    together = product(x)
    alone = torch.cat([product(x[i : i + 1]) for i in range(7)])
    assert torch.equal(together, alone)
    scalar = QuantDotProduct(weight, None, "scalar")(x)
    assert torch.allclose(together, scalar, rtol=1e-5, atol=1e-5)
    if variant not in ("scalar", "avx2"):  # the same kernel source, only the integer dot instruction differs
        _variant_or_skip("avx2")
        assert torch.equal(together, QuantDotProduct(weight, None, "avx2")(x))


@needs_kernels
@pytest.mark.parametrize(("variant", "paired"), (("avx2", False), ("avx2", True), ("avx512vnni", True)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_interleaved_layout_gives_the_rows_of_blocks_product(fmt, variant, paired):
    """The SIMD variants read the weight interleaved by groups of 8 rows, or two groups side by side (the paired
    layout, which avx512vnni reads and AVX2 reads too): a permutation of the blocks' bytes, so the product is the
    rows-of-blocks kernel's up to the order of float additions, and the same bits in either layout; a last group or
    pair padded past N writes nothing past N; every row count (1-9: AVX2's tiles of 1, 2 and 4 rows and their
    remainders, AVX-512's of 1-4) gives each row the bits it has alone (a pair whose second group is padded, 15 and 60
    columns; an odd last group, 37 and 129); the products of one weight share one interleaved copy a layout."""
    from engine_attention_cpu.quant import QuantDotProduct, interleaved

    emulated = _variant_or_skip(variant)
    per_unit = 16 if paired else 8
    shapes = [(8, 32), (15, 32), (37, 64), (60, 96), (129, 160), (64, 1536)]
    for cols, k in shapes + ([(33, 40)] if fmt == "int8" else []):
        weight = quantize(_weight(cols, k, seed=cols), fmt)
        data, scales = interleaved(weight, paired)
        assert data.shape == (-(-cols // per_unit), -(-k // 32), data.shape[2]) and data.dtype == torch.uint8
        assert (scales is None) == (fmt != "int8") and (scales is None or scales.numel() == data.shape[0] * per_unit)
        assert interleaved(weight, paired)[0] is data
        product = QuantDotProduct(weight, None, variant, emulated, paired=paired)
        assert product.data is data and QuantDotProduct(weight, None, variant, emulated, paired=paired).data is data
        rows_of_blocks = QuantDotProduct(weight, None, variant, emulated, interleave=False)
        assert rows_of_blocks.data.dim() == 2
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
        out = product(x)
        torch.testing.assert_close(out, rows_of_blocks(x), rtol=1e-5, atol=1e-5)
        for rows in range(1, 10):
            assert torch.equal(product(x[:rows]), out[:rows]), (fmt, cols, k, rows)
        if variant == "avx2":  # the other layout: the same bits
            assert torch.equal(QuantDotProduct(weight, None, variant, emulated, paired=not paired)(x), out)


@pytest.mark.parametrize(("variant", "paired"), (("avx2", False), ("avx2", True), ("avx512vnni", True)))
@pytest.mark.parametrize("fmt", ("q4_1", "q8_0"))
def test_a_weight_streamed_past_the_prefetch_threshold_gives_the_same_product(fmt, variant, paired):
    """A weight of many megabytes (an LM head's): each thread's stream runs longer than kHardwareStreamBytes, where
    the one-group tiles leave the prefetching to the CPU until the last stretch; the product is still the
    rows-of-blocks kernel's, and each row has the bits it has alone."""
    from engine_attention_cpu.quant import QuantDotProduct

    emulated = _variant_or_skip(variant)
    cols, k = 24584, 512  # 7.9 MB of Q4_1, 13.4 MB of Q8_0; an odd last group of 8 rows (a pair's padded group)
    weight = quantize(_weight(cols, k, seed=3), fmt)
    product = QuantDotProduct(weight, None, variant, emulated, paired=paired)
    rows_of_blocks = QuantDotProduct(weight, None, variant, emulated, interleave=False)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    out = product(x)
    torch.testing.assert_close(out, rows_of_blocks(x), rtol=1e-5, atol=1e-5)
    for row in range(3):
        assert torch.equal(product(x[row : row + 1]), out[row : row + 1]), row


@needs_kernels
def test_interleaved_kernel_refuses_a_layout_of_another_width():
    from engine_attention_cpu import _quant
    from engine_attention_cpu.quant import FORMAT_IDS, interleaved

    for paired in (False, True):
        data, _ = interleaved(quantize(_weight(16, 64), "q4_1"), paired)
        with pytest.raises(RuntimeError, match="interleaved weight must be"):
            _quant.linear(torch.empty(1, 24), torch.randn(1, 64), data, None, FORMAT_IDS["q4_1"], 1, None)
    with pytest.raises(RuntimeError, match="scalar variant"):
        _quant.linear(torch.empty(1, 16), torch.randn(1, 64), data, None, FORMAT_IDS["q4_1"], 0, None)


@needs_kernels
def test_the_avx512_variant_refuses_the_groups_layout():
    """avx512vnni reads two groups at a time from the paired layout: given the groups' layout (an AVX2 CPU's) the
    kernel says so, and so does the product asked for it."""
    from engine_attention_cpu.quant import FORMAT_IDS, QuantDotProduct, _ops, interleaved

    emulated = _variant_or_skip("avx512vnni")
    weight = quantize(_weight(16, 64), "q4_1")
    data, _ = interleaved(weight, paired=False)
    with pytest.raises(RuntimeError, match="reads the paired interleaved layout"):
        _ops(emulated).linear(torch.empty(1, 16), torch.randn(1, 64), data, None, FORMAT_IDS["q4_1"], 2, None)
    with pytest.raises(ValueError, match="paired interleaved layout only"):
        QuantDotProduct(weight, None, "avx512vnni", emulated, paired=False)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_row_lookup_of_a_quantized_table_is_the_references_rows(fmt):
    """The captured decode step's embedding (one C++ call) gives the rows of the torch reference's de-quantized
    table bit for bit, repeated ids included; an id past the table is an IndexError, not a read past it."""
    from engine_attention_cpu.quant import row_lookup

    k = 70 if fmt == "int8" else 96
    weight = quantize(_weight(37, k, seed=3), fmt)
    lookup = row_lookup(weight)
    ids = torch.tensor([5, 0, 36, 5, 17])
    rows = lookup(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, dequantize(weight)[ids])
    assert lookup(torch.tensor([], dtype=torch.int64)).shape == (0, k)
    with pytest.raises(IndexError, match="out of the table's 37 rows"):
        lookup(torch.tensor([3, 37]))


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_gemm_and_cpp_dequantize_equal_the_reference(fmt):
    """The product that de-quantizes the weight a panel at a time under the GEMM's tile is the float32 GEMM on the
    de-quantized weight bit for bit: ragged last panels, several k chunks, rows past a row block, int8 widths that are
    not whole blocks, bias."""
    from engine_attention_cpu.gemm import CpuPackedLinear, cpu_gemm_available
    from engine_attention_cpu.quant import DequantizedGemmProduct
    from engine_attention_cpu.quant import dequantize as cpp_dequantize

    k = 70 if fmt == "int8" else 96
    weight = quantize(_weight(37, k), fmt)
    assert torch.equal(cpp_dequantize(weight), dequantize(weight))
    if not cpu_gemm_available():
        pytest.skip("the AVX2 GEMM is not built")
    shapes = [(37, k, 13), (64, 1536, 100), (33, 1216, 5)] + ([(20, 1200, 7), (9, 24, 3)] if fmt == "int8" else [])
    for cols, width, rows in shapes:
        weight = quantize(_weight(cols, width, seed=rows), fmt)
        x, bias = torch.randn(rows, width), torch.randn(cols)
        out = DequantizedGemmProduct(weight, bias)(x)
        assert torch.equal(out, CpuPackedLinear(dequantize(weight), bias)(x)), (cols, width, rows)
        assert torch.allclose(out, x @ dequantize(weight).T + bias, rtol=1e-4, atol=1e-4)
    assert DequantizedGemmProduct(weight, None)(x.bfloat16()).dtype == torch.bfloat16


@needs_kernels
def test_kernels_refuse_what_they_cannot_take():
    from engine_attention_cpu import _quant

    weight = quantize(_weight(8, 64), "q4_0")
    with pytest.raises(RuntimeError, match="bytes"):
        _quant.linear(torch.empty(1, 8), torch.randn(1, 64), weight.data[:, :20].contiguous(), None, 0, 0, None)
    with pytest.raises(RuntimeError, match="scales"):
        _quant.linear(torch.empty(1, 8), torch.randn(1, 64), quantize(_weight(8, 64), "int8").data, None, 3, 0, None)


@needs_kernels
@pytest.mark.parametrize("variant", ALL_VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_run_each_product_kind_exactly(fmt, variant):
    """The cpu fused-MoE operation on packed experts: experts with fewer rows than the switch run the integer dot
    products (equal to the reference that rounds the activations per block), the others the weight de-quantized into
    the GEMM (equal to the float reference on de-quantized weights), and a step mixing both kinds gives each token
    its own experts' kind; another rank's experts are left out (expert_map)."""
    from engine.model.layers.moe_reference import dequantize_experts, fused_experts, quantized_fused_experts
    from engine.model.quant_formats import QuantizedExperts
    from engine_attention_cpu.gemm import cpu_gemm_available
    from engine_attention_cpu.moe import NEVER, CpuQuantizedExperts

    emulated = _variant_or_skip(variant)
    gen = torch.Generator().manual_seed(7)
    shapes = [(64, 96)] + ([(48, 40)] if fmt == "int8" else [])  # int8 rows that are not whole blocks
    for hidden, intermediate in shapes:
        w13 = QuantizedExperts.stack([quantize(_weight(2 * intermediate, hidden, e), fmt) for e in range(6)])
        w2 = QuantizedExperts.stack([quantize(_weight(hidden, intermediate, 10 + e), fmt) for e in range(6)])
        # tokens 0-9 on expert 1 (a prompt-sized product), token 10 alone on expert 4, token 11 on expert 5
        ids = torch.tensor([[1, 3]] * 10 + [[4, 0], [5, 2]])
        weights = torch.rand(ids.shape, generator=gen)
        x = torch.randn(len(ids), hidden, generator=gen)
        dot_form = quantized_fused_experts(x, w13, w2, weights, ids)
        float_form = fused_experts(x, dequantize_experts(w13), dequantize_experts(w2), weights, ids)
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            CpuQuantizedExperts(w13, w2, variant, NEVER, emulated)(x, weights, ids), dot_form, **tol
        )
        if not cpu_gemm_available():
            continue
        torch.testing.assert_close(
            CpuQuantizedExperts(w13, w2, variant, 1, emulated)(x, weights, ids), float_form, **tol
        )
        # switch at 4 rows: experts 1 and 3 (10 rows each) run de-quantized, 0, 2, 4 and 5 (one row) by integer
        # dots; weighing only each token's first expert (1 for tokens 0-9, 4 and 5 for tokens 10 and 11) gives
        # every row one kind
        first = weights.clone()
        first[:, 1] = 0
        mixed = CpuQuantizedExperts(w13, w2, variant, 4, emulated)(x, first, ids)
        want = torch.cat(
            [
                fused_experts(x, dequantize_experts(w13), dequantize_experts(w2), first, ids)[:10],
                quantized_fused_experts(x, w13, w2, first, ids)[10:],
            ]
        )
        torch.testing.assert_close(mixed, want, **tol)
        expert_map = torch.tensor([-1, -1, -1, 0, 1, 2])  # this rank holds experts 3-5
        local = [w13.narrow(3, 3), w2.narrow(3, 3)]
        got = CpuQuantizedExperts(*local, variant, NEVER, emulated)(x, weights, ids, expert_map)
        torch.testing.assert_close(got, quantized_fused_experts(x, *local, weights, ids, expert_map), **tol)
