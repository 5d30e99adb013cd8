"""The ``cpu`` layer kernels' packed GEMM (``csrc/gemm.cpp``): every ISA variant (natively or over SIMDe) equal to the
avx2 variant bit for bit; against a float64 product over the register tile's edges (rows not a multiple of 6,
columns not a multiple of 16, K split into chunks), with and without bias; rows independent of their batch and of
the thread count; bfloat16 activations, strided rows, empty batches, concurrent callers; and which weights the
loader packs."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine_attention_cpu._gemm") is None, reason="the cpu GEMM is not built"
)


@pytest.fixture(scope="module")
def cpu():
    from engine_attention_cpu.gemm import cpu_gemm_available
    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    if not cpu_gemm_available():
        pytest.skip("built without AVX2 + FMA")
    return CpuLayerKernels()


def reference(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def assert_float32_product(actual, x, weight, bias=None):
    """Within a float32 dot product's error bound: K roundings of terms no larger than |x| . |w|."""
    expected = reference(x, weight, bias)
    scale = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = (x.shape[-1] + 2) * 2**-24 * scale + 1e-30
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    excess = ((actual.double() - expected).abs() - bound).max().item() if actual.numel() else 0.0
    assert excess <= 0, f"max |diff| {(actual.double() - expected).abs().max().item():.3g} past the bound"


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 72, 73, 150])
@pytest.mark.parametrize("out_features,in_features", [(16, 64), (40, 7), (96, 576), (24, 1000), (48, 1536)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_packed_product_matches_float64(cpu, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    product = cpu.pack_linear(weight, bias)
    assert_float32_product(product(x), x, weight, bias)


def _gemm_variant_cases():
    """(variant, emulated) for every GEMM variant past avx2: run natively where the CPU has it, else over SIMDe's
    AVX-512 (the ``_gemm_emulated`` build, made where the CPU lacks AVX-512); a skip says which is missing."""
    from engine_attention_cpu.gemm import gemm_variants

    cases = []
    for variant, runnable in gemm_variants().items():
        if variant == "avx2":
            continue
        if runnable:
            cases.append(pytest.param(variant, False, id=f"{variant}-native"))
        elif importlib.util.find_spec("engine_attention_cpu._gemm_emulated") is not None:
            cases.append(pytest.param(variant, True, id=f"{variant}-simde"))
        else:
            cases.append(
                pytest.param(
                    variant,
                    False,
                    id=variant,
                    marks=pytest.mark.skip(reason="neither this CPU nor a SIMDe build runs it"),
                )
            )
    return cases


@pytest.mark.parametrize(
    "variant,emulated", _gemm_variant_cases() if importlib.util.find_spec("engine_attention_cpu._gemm") else []
)
def test_every_gemm_variant_gives_the_avx2_variants_bits(cpu, variant, emulated):
    """One kernel logic, every ISA: the avx512 variant's 12x32 tile and 4-panel decode rows run the same fused
    multiply-add chains as the avx2 variant, so its outputs are equal bit for bit over the tiles' edges (rows 1-4
    take the decode path; 12, 13, 72 and 73 the tile and row-block edges; an odd panel count leaves a single panel;
    K past one chunk), with and without bias."""
    from engine_attention_cpu.gemm import CpuPackedLinear

    gen = torch.Generator().manual_seed(11)
    for out_features, in_features in [(16, 64), (40, 7), (200, 1536), (96, 576), (24, 1000)]:
        weight = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        for with_bias in (None, bias):
            avx2 = CpuPackedLinear(weight, with_bias, "avx2")
            wide = CpuPackedLinear(weight, with_bias, variant, emulated=emulated)
            assert wide.variant == variant
            for rows in (1, 2, 3, 4, 5, 12, 13, 72, 73):
                x = torch.randn(rows, in_features, generator=gen)
                assert torch.equal(wide(x), avx2(x)), (out_features, in_features, rows, with_bias is not None)


def test_the_widest_gemm_variant_is_the_default_and_an_absent_one_is_refused(cpu):
    from engine_attention_cpu.gemm import CpuPackedLinear, gemm_variants

    found = gemm_variants()
    assert list(found) == ["avx2", "avx512"] and found["avx2"]
    widest = [name for name, ok in found.items() if ok][-1]
    assert CpuPackedLinear(torch.randn(8, 8)).variant == widest
    names = [c.name for c in cpu.product_candidates(torch.float32)]
    assert names[0] == f"cpu-{widest}" and "cpu-avx2" in names
    if not found["avx512"]:
        with pytest.raises(RuntimeError, match="avx512"):
            CpuPackedLinear(torch.randn(8, 8), variant="avx512")


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(cpu):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 1536, generator=gen)  # 13 panels (the last ragged), K in three chunks
    product = cpu.pack_linear(weight, torch.randn(200, generator=gen))
    batch = torch.randn(97, 1536, generator=gen)
    together = product(batch)
    for i in (0, 5, 6, 96):
        assert torch.equal(product(batch[i : i + 1]), together[i : i + 1])
    assert torch.equal(product(batch[40:53]), together[40:53])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


def test_half_activations_strided_rows_and_empty_batches(cpu):
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(48, 64, generator=gen)
    product = cpu.pack_linear(weight)
    x = torch.randn(9, 64, generator=gen)
    out = product(x.bfloat16())  # a bfloat16 GEMM with float32 accumulation, rounded once
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, product(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)
    wide = torch.randn(9, 3 * 64, generator=gen)
    assert torch.equal(product(wide[:, 64:128]), product(wide[:, 64:128].contiguous()))  # row stride 192
    assert torch.equal(product(wide.t()[:64].t()), product(wide[:, :64].contiguous()))  # column stride 9
    batched = torch.randn(2, 3, 64, generator=gen)
    assert torch.equal(product(batched), product(batched.reshape(6, 64)).view(2, 3, 48))
    assert product(x[:0]).shape == (0, 48)


def test_concurrent_callers_each_get_their_own_product(cpu):
    """Engines in several threads share one kernel set, and the product runs without the GIL: the
    packed input is per calling thread, so concurrent calls cannot overwrite each other's."""
    gen = torch.Generator().manual_seed(7)
    product = cpu.pack_linear(torch.randn(64, 576, generator=gen))
    inputs = [torch.randn(rows, 576, generator=gen) for rows in (150, 7, 64, 1)]
    expected = [product(x) for x in inputs]
    failures = []

    def call(i):
        for _ in range(20):
            if not torch.equal(product(inputs[i]), expected[i]):
                failures.append(i)

    workers = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures


def test_which_weights_are_packed(cpu):
    from engine.model.layers.gemm import PackedLinear
    from engine_attention_cpu.gemm import CpuPackedLinear

    assert isinstance(cpu.pack_linear(torch.randn(32, 16)), CpuPackedLinear)
    assert cpu.pack_linear(torch.randn(32, 16, dtype=torch.float64)) is None  # plain product
    native_bf16 = cpu.pack_linear(torch.randn(32, 16).bfloat16())  # 16-bit weights: native's choice
    assert native_bf16 is None or isinstance(native_bf16, PackedLinear)


def test_a_model_loaded_with_the_cpu_kernels_packs_every_product_and_agrees(tiny_llama):
    from engine.config import ModelConfig
    from engine.model.layers.linear import linear_layers
    from engine.model.loader import load_model
    from engine.model.model_info import resolve_model
    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    info = resolve_model(ModelConfig(model=tiny_llama, dtype="float32"))
    kernels = CpuLayerKernels()
    model = load_model(info, torch.device("cpu"), show_progress=False, layer_kernels=kernels)
    linears = linear_layers(model)
    # every product is the one measured fastest for its shape: the GEMM's variants compete with torch's
    assert kernels.product_table.key["candidates"][0].split("@")[0] in ("cpu-avx2", "cpu-avx512")
    assert linears and all(m.packed is not None for m in linears) and model.logits_gemm is not None
    chosen = {c.chosen["decode"] for c in kernels.product_table.choices.values()}
    assert chosen <= {"cpu-avx2", "cpu-avx512", "onednn", "torch"}
    gen = torch.Generator().manual_seed(8)
    for module in linears:
        x = torch.randn(11, module.weight.shape[1], generator=gen)
        assert_float32_product(module(x), x, module.weight, module.bias)
    hidden = torch.randn(4, info.hf_config.hidden_size, generator=gen)
    assert_float32_product(model.compute_logits(hidden), hidden, model.lm_head.weight)
