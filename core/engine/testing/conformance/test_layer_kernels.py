"""Layer kernels match the built-in ``native`` torch ops (RMSNorm, fused add + RMSNorm, SiLU-and-multiply,
RoPE, packed linear products) and the torch references (fused MoE, Mamba's convolution and scans), in float32 and
bfloat16."""

from __future__ import annotations

from inspect import signature

import pytest
import torch

from engine.testing import inspect
from engine.testing.conformance.conftest import implementation


@pytest.fixture
def kernels(layer_kernels_name):
    return implementation("layer_kernels", layer_kernels_name).create()


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_elementwise_kernels_match_native(kernels, dtype):
    from engine.model.layers.native_kernels import NativeLayerKernels

    native = NativeLayerKernels()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    residual = torch.randn(7, 96, generator=gen).to(dtype)
    weight = torch.rand(96, generator=gen).to(dtype) + 0.5
    torch.testing.assert_close(
        kernels.rms_norm(x.clone(), weight, 1e-6), native.rms_norm(x.clone(), weight, 1e-6), **tolerance(dtype)
    )
    got = kernels.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    want = native.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tolerance(dtype))
    gate_up = torch.randn(7, 2 * 96, generator=gen).to(dtype)
    torch.testing.assert_close(
        kernels.silu_and_mul(gate_up.clone()), native.silu_and_mul(gate_up.clone()), **tolerance(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_embedding_matches_native(kernels, dtype):
    from engine.model.layers.native_kernels import NativeLayerKernels

    head_size, heads, kv_heads, tokens = 64, 4, 2, 9
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    angles = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)  # rotate_half's sign folded in
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    query = torch.randn(tokens, heads * head_size, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads * head_size, generator=gen).to(dtype)
    got = kernels.rotary_embedding(positions, query.clone(), key.clone(), cos, sin, head_size)
    want = NativeLayerKernels().rotary_embedding(positions, query.clone(), key.clone(), cos, sin, head_size)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tolerance(dtype))


def test_packed_products_equal_the_plain_product(kernels):
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    product = kernels.pack_linear(weight, bias)
    if product is None:
        pytest.skip("this implementation keeps the plain product")
    for rows in (1, 5, 64):
        x = torch.randn(rows, 32, generator=gen)
        torch.testing.assert_close(product(x), torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariant_products_give_each_row_the_bits_it_gets_alone(layer_kernels_name, dtype):
    """Kernels that declare batch invariance (``batch_invariant_unsupported_reason = None``): once configured with
    ``model.batch_invariant``, every product they pack for float weights and every product they offer on packed ones
    (k long enough for several chunks) gives a row the same bits at every row count; the norms and activations
    too."""
    from engine.config import VllmConfig
    from engine.model.quant_formats import quantize

    impl = implementation("layer_kernels", layer_kernels_name)
    if impl.cls.batch_invariant_unsupported_reason is not None:
        pytest.skip(
            f"'{layer_kernels_name}' does not run batch-invariant: {impl.cls.batch_invariant_unsupported_reason}"
        )
    kernels = implementation("layer_kernels", layer_kernels_name, batch_invariant=True).create()
    kernels.configure(VllmConfig.load(batch_invariant=True))
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(72, 1216, generator=gen) * 0.05, torch.randn(72, generator=gen)
    x = torch.randn(300, 1216, generator=gen).to(dtype)
    products = {"float": kernels.pack_linear(weight.to(dtype), bias.to(dtype))}
    packed = quantize(weight, "q4_1")
    if hasattr(kernels, "quantized_product_candidates"):  # any of them may be the one measured fastest
        for candidate in kernels.quantized_product_candidates("q4_1"):
            products[candidate.name] = candidate.make(packed, bias)
    norm_weight = torch.rand(1216, generator=gen).to(dtype) + 0.5
    ops = {
        **{name: p for name, p in products.items() if p is not None},
        "rms_norm": lambda rows: kernels.rms_norm(rows, norm_weight, 1e-6),
        "silu_and_mul": kernels.silu_and_mul,
    }
    for name, op in ops.items():
        whole = op(x.clone())
        for rows in (1, 2, 3, 4, 5, 7, 64, 299):
            part = op(x[:rows].clone())
            assert torch.equal(part, whole[:rows]), f"{name}: rows 0..{rows} differ from the {len(x)}-row call"
        assert torch.equal(op(x[150:151].clone()), whole[150:151]), f"{name}: row 150 alone differs"


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
def test_quantized_products_match_dequantize_then_multiply(kernels, fmt):
    """Every product the kernels offer on packed weights (``quantized_product_candidates``) equals the de-quantized
    weight's product, within the rounding of activations quantized per block of 32 to int8 (integer kernels)."""
    from engine.model.quant_formats import dequantize, quantize

    gen = torch.Generator().manual_seed(1)
    weight = quantize(torch.randn(40, 96, generator=gen) * 0.05, fmt)
    x, bias = torch.randn(5, 96, generator=gen), torch.randn(40, generator=gen)
    dense = dequantize(weight)
    expected = x @ dense.T + bias
    allowed = x.abs().amax() / 127 * dense.abs().sum(1) + 1e-4  # one int8 step of x on every weight
    candidates = kernels.quantized_product_candidates(fmt)
    assert candidates, "quantized_product_candidates must offer at least one product"
    for candidate in candidates:
        product = candidate.make(weight, bias)
        out = product(x)
        assert out.shape == expected.shape and out.dtype == torch.float32, candidate.name
        assert ((out - expected).abs() <= allowed).all(), candidate.name
        assert product(x.bfloat16()).dtype == torch.bfloat16, candidate.name


def test_a_captured_decode_step_gives_the_eager_bits(layer_kernels_name, tiny_model):
    """Layer kernels that capture the decode step (``capture_decode_step``): whole greedy generations with logprobs
    equal the eager model's bit for bit; kernels that do not capture are skipped."""
    from engine import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 110 + 13 * i))} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    results, captured = {}, {}
    for enforce_eager in (True, False):
        llm = LLM(
            model=tiny_model,
            layer_kernels=layer_kernels_name,
            dtype="float32",
            kv_cache_memory="32MiB",
            enforce_eager=enforce_eager,
        )
        runner = inspect(llm).model_runner
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[enforce_eager] = [
            (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outputs
        ]
        captured[enforce_eager] = (runner.decode_step is not None, runner.num_captured_steps)
        llm.shutdown()
    if not captured[False][0]:
        pytest.skip(f"the '{layer_kernels_name}' layer kernels do not capture this model's decode step")
    assert captured[False][1] > 0 and captured[True] == (False, 0)
    assert results[False] == results[True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [0, 1, 3, 37])
def test_fused_moe_matches_the_reference(kernels, dtype, tokens):
    """The fused-MoE operation (``pack_experts`` where the kernels pack experts, else their ``fused_moe``) equals the
    torch reference on every routing shape: tokens sharing experts, experts with none, a decode-sized step, an
    empty step, and experts held by another rank (``expert_map``, expert parallelism)."""
    from types import SimpleNamespace

    from engine.interfaces.layer_kernels import MoERouting
    from engine.model.layers.moe_reference import fused_experts, select_experts

    gen = torch.Generator().manual_seed(3)
    num_experts, hidden, intermediate = 8, 48, 40
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.2).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = kernels.select_experts(logits, MoERouting(top_k=3, renormalize=True))
    want_weights, want_ids = select_experts(logits, MoERouting(top_k=3, renormalize=True))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
    expert_map[4:] = torch.arange(4)  # this rank holds experts 4-7 of 8
    for local, emap in (((w13, w2)), None), ((w13[4:], w2[4:]), expert_map):
        layer = SimpleNamespace(w13_weight=local[0], w2_weight=local[1], expert_map=emap, packed=None)
        layer.packed = kernels.pack_experts(*local)
        got = kernels.fused_moe(x, layer, weights, ids)
        want = fused_experts(x, local[0], local[1], weights, ids, emap)
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **tolerance(dtype))


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_quantized_experts_match_the_reference(kernels, fmt, tokens):
    """Experts a quantization method packed (``pack_quantized_experts``) give the fused-MoE output of their
    de-quantized weights, within the error of rounding the activations to int8 per block of 32 (as integer-dot
    kernels do): no further from it than the reference of that rounding is, on all experts or on another rank's."""
    from types import SimpleNamespace

    from engine.interfaces.layer_kernels import MoERouting
    from engine.model.layers.moe_reference import dequantize_experts, fused_experts, quantized_fused_experts
    from engine.model.quant_formats import QuantizedExperts, quantize

    gen = torch.Generator().manual_seed(5)
    num_experts, hidden, intermediate = 8, 64, 96
    w13 = QuantizedExperts.stack([quantize(w, fmt) for w in torch.randn(num_experts, 2 * intermediate, hidden) * 0.2])
    w2 = QuantizedExperts.stack([quantize(w, fmt) for w in torch.randn(num_experts, hidden, intermediate) * 0.2])
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = kernels.select_experts(torch.randn(tokens, num_experts, generator=gen), MoERouting(top_k=3))
    expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
    expert_map[4:] = torch.arange(4)  # this rank holds experts 4-7 of 8
    for (q13, q2), emap in (((w13, w2), None), ((w13.narrow(4, 4), w2.narrow(4, 4)), expert_map)):
        layer = SimpleNamespace(expert_map=emap, packed=kernels.pack_quantized_experts(q13, q2))
        got = kernels.fused_moe(x, layer, weights, ids)
        want = fused_experts(x, dequantize_experts(q13), dequantize_experts(q2), weights, ids, emap)
        rounding = (quantized_fused_experts(x, q13, q2, weights, ids, emap) - want).abs().max().item()
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, want, atol=1.5 * rounding + 1e-4, rtol=0)


def _mamba_case(lengths: list[int], dtype: torch.dtype, seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    total, rows = sum(lengths), len(lengths)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return gen, total, rows, starts, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [[1, 1, 1], [9, 1, 30, 4]], ids=["decode", "mixed"])
def test_mamba_state_kernels_match_the_reference(kernels, dtype, lengths):
    """Mamba's causal convolution, Mamba2's scan (single step and chunked) and Mamba1's selective scan equal the torch
    reference on a batch of requests laid end to end, each from its own conv / SSM state, and leave the same states
    behind (the state a request carries into its next step)."""
    from engine.model.layers import mamba_reference

    _, total, rows, starts, randn = _mamba_case(lengths, dtype)
    channels, kernel = 24, 4
    x, weight, bias = randn(total, channels), randn(channels, kernel, scale=0.5), randn(channels)
    conv_state = randn(rows, channels, kernel - 1)
    want_state = conv_state.clone()
    got = kernels.causal_conv1d(x, weight, bias, conv_state, starts, "silu")
    want = mamba_reference.causal_conv1d(x, weight, bias, want_state, starts, "silu")
    torch.testing.assert_close(got, want, **tolerance(dtype))
    torch.testing.assert_close(conv_state, want_state, **tolerance(dtype))

    heads, head_dim, groups, state = 4, 8, 2, 16
    args = (
        randn(total, heads, head_dim),
        randn(total, heads),
        -torch.rand(heads) * 2,
        randn(total, groups, state),
        randn(total, groups, state),
        torch.randn(heads),
        torch.randn(heads) * 0.5,
        (0.0, float("inf")),
    )
    ssm_state = randn(rows, heads, head_dim, state)
    want_ssm = ssm_state.clone()
    got = kernels.mamba2_scan(*args, ssm_state, starts, 8)
    want = mamba_reference.mamba2_scan(*args, want_ssm, starts, 8)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    torch.testing.assert_close(ssm_state, want_ssm, **tolerance(dtype))

    dims = (total, channels)
    mamba1 = (
        randn(*dims),
        randn(*dims),
        -torch.rand(channels, state),
        randn(total, state),
        randn(total, state),
        torch.randn(channels),
        randn(*dims),
        torch.randn(channels) * 0.5,
    )
    ssm_state = randn(rows, channels, state)
    want_ssm = ssm_state.clone()
    got = kernels.selective_scan(*mamba1, ssm_state, starts)
    want = mamba_reference.selective_scan(*mamba1, want_ssm, starts)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    torch.testing.assert_close(ssm_state, want_ssm, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["runs", "scattered", "one adapter", "base only rows", "merged slices"])
def test_batched_lora_product_matches_each_tokens_own_product(kernels, dtype, layout):
    """``add_lora`` adds, to every token's row, its own adapter's ``B (A x)`` and nothing to the base model's rows:
    tokens in runs per adapter (requests one after another), scattered, all on one adapter, mixed with rows of
    the base model, and a merged layer (three slices, B block-diagonal, ``out_slices`` given); checked against each
    token's product alone (the definition, not the torch reference)."""
    import numpy as np

    from engine.lora.mapping import LoRAMapping

    gen = torch.Generator().manual_seed(7)
    slots, rank, hidden, out = 3, 8, 40, 56
    lora_a = torch.randn(slots, rank, hidden, generator=gen)
    lora_b = torch.randn(out, slots, rank, generator=gen) * 0.1
    out_slices = None
    if layout == "merged slices":
        if "out_slices" not in signature(kernels.add_lora).parameters:
            pytest.skip("a contract 1.13 add_lora: it takes no out_slices")
        # q/k/v-like: 24 + 16 + 16 rows, each with its own 4 of B's 12 columns
        out_slices = ((0, 24), (24, 16), (40, 16))
        lora_a = torch.randn(slots, 3 * 4, hidden, generator=gen)
        lora_b = torch.zeros(out, slots, 3 * 4)
        for index, (offset, size) in enumerate(out_slices):
            lora_b[offset : offset + size, :, 4 * index : 4 * index + 4] = torch.randn(size, slots, 4) * 0.1
    token_slots = {
        "runs": [0] * 5 + [2] * 7 + [-1] * 3 + [1] * 4,
        "scattered": [1, -1, 0, 1, 2, 0, -1, 2, 1, 0, 0, 2],
        "one adapter": [2] * 9,
        "base only rows": [-1, -1, 1, -1],
        "merged slices": [2, 0, -1, 1, 1, 0, 2],
    }[layout]
    x = torch.randn(len(token_slots), hidden, generator=gen).to(dtype)
    y = torch.randn(len(token_slots), out, generator=gen).to(dtype)
    mapping = LoRAMapping.from_token_slots(np.array(token_slots))
    assert mapping is not None
    want = y.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            want[t] += (lora_b[:, slot] @ (lora_a[slot] @ x[t].float())).to(dtype)
    if out_slices is None:
        got = kernels.add_lora(y.clone(), x, lora_a, lora_b, mapping)
    else:
        got = kernels.add_lora(y.clone(), x, lora_a, lora_b, mapping, out_slices=out_slices)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tolerance(dtype))
