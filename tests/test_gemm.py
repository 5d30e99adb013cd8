"""bfloat16 models on CPUs without bfloat16 GEMMs: float32 weights, products rounded to bfloat16."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import gemm
from engine.model.layers.gemm import widen_gemm_weights
from engine.model.layers.linear import linear, linear_layers
from engine.model.layers.native_kernels import NativeLayerKernels
from engine.model.layers.packing import pack_linear_layers


def test_widened_product_is_a_bf16_gemm_with_float32_accumulation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).bfloat16()
    w = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    out = linear(x, w.float(), bias.float())
    assert out.dtype == torch.bfloat16
    expected = (x.double() @ w.double().T + bias.double()).bfloat16()  # exact sum, one rounding
    assert (out.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-7
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), atol=0.1, rtol=2**-6)


def test_widening_follows_the_cpu(monkeypatch, tiny_llama):
    from engine.config import ModelConfig
    from engine.model.loader import load_model
    from engine.model.model_info import resolve_model

    info = resolve_model(ModelConfig(model=tiny_llama, dtype="bfloat16"))
    monkeypatch.setattr(gemm, "cpu_has_half_gemm", lambda dtype: False)
    widened = load_model(info, torch.device("cpu"), show_progress=False)
    qkv = widened.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and widened.logits_gemm is not None
    assert qkv.packed is not None and widened.model.layers[0].mlp.down_proj.packed is not None
    assert widened.model.embed_tokens.weight.dtype == torch.bfloat16  # lookups stay in the model dtype
    monkeypatch.setattr(gemm, "cpu_has_half_gemm", lambda dtype: True)
    kernels = NativeLayerKernels()
    native = load_model(info, torch.device("cpu"), show_progress=False, layer_kernels=kernels)
    assert native.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    # native bf16 GEMMs: the weights stay in bf16, and the bf16 products compete with the float32 ones
    assert {"torch-bfloat16", "onednn-bfloat16", "onednn", "torch"} <= set(kernels.product_table.key["candidates"])
    assert kernels.product_table.key["weight_dtype"] == "torch.bfloat16"
    assert not widen_gemm_weights(native, torch.float32, torch.device("cpu"))
    assert torch.equal(qkv.weight.bfloat16(), native.model.layers[0].self_attn.qkv_proj.weight)


def test_packed_lm_head_matches_the_plain_product():
    from engine.model.layers.gemm import PackedLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 64, generator=gen)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(PackedLinear(weight)(x), x @ weight.T, atol=1e-4, rtol=1e-5)
        assert PackedLinear(weight)(x.bfloat16()).dtype == torch.bfloat16


def test_packed_linear_layers_match_the_plain_products(tiny_llama):
    """The loader packs every linear layer of a float32 model on the CPU, and each packed layer gives
    the plain product."""
    from engine.config import ModelConfig
    from engine.model.loader import load_model
    from engine.model.model_info import resolve_model

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    model = load_model(
        resolve_model(ModelConfig(model=tiny_llama, dtype="float32")), torch.device("cpu"), show_progress=False
    )
    linears = linear_layers(model)
    assert linears and all(m.packed is not None for m in linears) and model.logits_gemm is not None
    gen = torch.Generator().manual_seed(2)
    for module in linears:
        x = torch.randn(9, module.weight.shape[1], generator=gen)
        plain = torch.nn.functional.linear(x, module.weight)
        torch.testing.assert_close(module(x), plain, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(module(x[:0]), plain[:0])  # an empty batch keeps its shape


@pytest.mark.parametrize("kernels_name", ["native", "cpu"])
def test_packed_layers_with_bias_add_it_once(kernels_name):
    """Column / QKV layers fold their bias into the packed product; a row-parallel layer adds its bias
    after the all-reduce, so its packed product must leave it out (else it would be added twice)."""
    from engine.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from engine.model.layers.native_kernels import NativeLayerKernels

    if kernels_name == "native":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("no oneDNN in this torch build")
        kernels = NativeLayerKernels()
    else:
        pytest.importorskip("engine_attention_cpu._gemm", reason="the cpu kernels are not built")
        from engine_attention_cpu.gemm import cpu_gemm_available
        from engine_attention_cpu.layer_kernels import CpuLayerKernels

        if not cpu_gemm_available():
            pytest.skip("the cpu GEMM was built without AVX2")
        kernels = CpuLayerKernels()
    gen = torch.Generator().manual_seed(3)
    layers = torch.nn.ModuleList(
        [
            MergedColumnParallelLinear(32, [24, 24], bias=True),
            QKVParallelLinear(32, 8, 4, 2, bias=True),
            RowParallelLinear(48, 32, bias=True),
        ]
    )
    for param in layers.parameters():
        param.data.normal_(generator=gen)
    assert pack_linear_layers(layers, kernels.pack_linear) == 3
    for module in layers:
        x = torch.randn(5, module.weight.shape[1], generator=gen)
        expected = torch.nn.functional.linear(x, module.weight, module.bias)
        torch.testing.assert_close(module(x), expected, atol=1e-4, rtol=1e-5)
