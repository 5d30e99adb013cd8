"""The ``cpu`` LayerKernels (fused C++ RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE) against the
built-in ``native`` torch ops, across dtypes, the 8-wide vector paths and their scalar tails, strided
rows and in-place views of a fused QKV output; and how ``device.layer_kernels`` chooses them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.model.layers.native_kernels import NativeLayerKernels

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine_attention_cpu._layers") is None, reason="the cpu layer kernels are not built"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
NATIVE = NativeLayerKernels()


@pytest.fixture(scope="module")
def cpu():
    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    return CpuLayerKernels()


def ulps(dtype) -> float:
    return {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]


def assert_within_ulps(actual, expected, n):
    """|actual - expected| <= n units in the last place of the dtype, relative to each value."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    bound = n * ulps(actual.dtype) * e.abs().clamp_min(1e-30) + 1e-30
    worst = ((a - e).abs() - bound).max().item()
    assert worst <= 0, f"off by more than {n} ulp: max |diff| {(a - e).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 20), (3, 8)])
def test_rms_norm_matches_native(cpu, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    out = cpu.rms_norm(x, weight, 1e-5)
    # float32: only the order of the sum of squares differs; half types may round once differently
    assert_within_ulps(out, NATIVE.rms_norm(x, weight, 1e-5), 4 if dtype == torch.float32 else 1)


def test_rms_norm_takes_strided_rows_and_head_shaped_input(cpu):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 3 * 64, generator=gen)
    q = qkv[:, :64]  # a strided view, as after splitting a fused QKV output
    weight = torch.rand(64, generator=gen) + 0.5
    assert_within_ulps(cpu.rms_norm(q, weight, 1e-6), NATIVE.rms_norm(q.contiguous(), weight, 1e-6), 4)
    heads = torch.randn(5, 4, 64, generator=gen)  # Qwen3's per-head norm of [tokens, heads, head_size]
    out = cpu.rms_norm(heads, weight, 1e-6)
    assert out.shape == heads.shape
    assert_within_ulps(out, NATIVE.rms_norm(heads, weight, 1e-6), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (7, 13)])
def test_fused_add_rms_norm_matches_native(cpu, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 4).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    expected_out, expected_sum = NATIVE.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    out, summed = cpu.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(summed, expected_sum)  # the residual add rounds exactly as torch's add
    assert_within_ulps(out, expected_out, 4 if dtype == torch.float32 else 1)


def test_fused_add_rms_norm_writes_in_place(cpu):
    x, residual, weight = torch.randn(4, 32), torch.randn(4, 32), torch.ones(32)
    expected_sum = x + residual
    out, summed = cpu.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert out.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expected_sum)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,width", [(1, 3072), (33, 3072), (4, 2 * 13)])
def test_silu_and_mul_matches_native(cpu, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
    out = cpu.silu_and_mul(x)
    expected = NATIVE.silu_and_mul(x)
    assert out.shape == expected.shape == (rows, width // 2)
    if dtype == torch.float32:  # a vectorised exp against torch's: a few ulp apart
        torch.testing.assert_close(out, expected, rtol=4e-6, atol=1e-7)
    else:  # silu rounds to the half type before the product, as torch's does; the rounding may flip once
        assert_within_ulps(out, expected, 2)


def test_silu_and_mul_saturates_without_nan(cpu):
    x = torch.tensor([[-200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4] + [1.0] * 8])
    out = cpu.silu_and_mul(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, NATIVE.silu_and_mul(x), rtol=1e-6, atol=1e-30)


def rope_tables(rotary_dim: int, positions: int = 4096):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (48, 48), (64, 32), (20, 20)])
def test_rotary_embedding_is_bit_identical_and_in_place(cpu, dtype, head_size, rotary_dim):
    gen = torch.Generator().manual_seed(head_size + rotary_dim)
    tokens, heads, kv_heads = 11, 9, 3
    cos, sin = rope_tables(rotary_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    q_size, kv_size = heads * head_size, kv_heads * head_size
    expected_q, expected_k = NATIVE.rotary_embedding(
        positions, qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], cos, sin, head_size
    )
    value = qkv[:, q_size + kv_size :].clone()
    q, k = cpu.rotary_embedding(positions, qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], cos, sin, head_size)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert q.data_ptr() == qkv.data_ptr()  # rotated inside the fused output
    assert torch.equal(qkv[:, q_size + kv_size :], value)  # v untouched


def test_rotary_embedding_rejects_positions_past_the_table(cpu):
    cos, sin = rope_tables(64, positions=16)
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        cpu.rotary_embedding(torch.tensor([3, 16]), q, k, cos, sin, 64)


class RecordedOps:
    """The C++ ops module, recording which ops are called."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return op(*args, **kwargs)

        return call


def test_inputs_the_kernels_do_not_take_go_to_the_native_ops():
    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    kernels = CpuLayerKernels()
    kernels._ops = recorded = RecordedOps(kernels._ops)
    x, weight = torch.randn(3, 10, dtype=torch.float64), torch.rand(10, dtype=torch.float64)
    torch.testing.assert_close(kernels.silu_and_mul(x), NATIVE.silu_and_mul(x), rtol=0, atol=0)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), NATIVE.rms_norm(x, weight, 1e-6), rtol=0, atol=0)
    assert recorded.calls == []  # float64 is not a dtype the C++ kernels take
    recorded.calls.clear()
    kernels.rms_norm(x.float(), weight.float(), 1e-6)
    kernels.silu_and_mul(x[:, :10].float())
    assert recorded.calls == ["rms_norm", "silu_and_mul"]  # the dtypes the C++ kernels take do reach them


def test_auto_chooses_the_cpu_kernels_and_bad_names_list_the_choices():
    from engine.config import ConfigError, VllmConfig
    from engine.interfaces.base import SelectionContext
    from engine.plugins import get_plugin_manager

    plugins = get_plugin_manager()
    ctx = SelectionContext(VllmConfig.load(device="cpu"))
    assert plugins.select("layer_kernels", "auto", ctx).name == "cpu"
    assert plugins.select("layer_kernels", "native", ctx).name == "native"
    with pytest.raises(ConfigError, match=r"device.layer_kernels: unknown layer_kernels 'fused'.*'cpu'.*'native'"):
        plugins.select("layer_kernels", "fused", ctx)


def test_model_layers_use_the_chosen_kernels_and_agree(tiny_llama):
    from engine.config import ModelConfig
    from engine.model.loader import load_model
    from engine.model.model_info import resolve_model
    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    info = resolve_model(ModelConfig(model=tiny_llama, dtype="float32"))
    fused = load_model(info, torch.device("cpu"), show_progress=False, layer_kernels=CpuLayerKernels())
    native = load_model(info, torch.device("cpu"), show_progress=False)
    layer = fused.model.layers[0]
    assert isinstance(layer.input_layernorm.kernels, CpuLayerKernels)
    assert isinstance(layer.mlp.act_fn.kernels, CpuLayerKernels)
    assert isinstance(layer.self_attn.rotary_emb.kernels, CpuLayerKernels)
    assert isinstance(native.model.layers[0].input_layernorm.kernels, NativeLayerKernels)
    # the decoder stack without attention: norms, residual adds and the MLP
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, info.hf_config.hidden_size, generator=gen)
    outputs = []
    for model in (fused, native):
        h, residual = hidden.clone(), None
        for layer in model.model.layers:
            if residual is None:
                residual, h = h, layer.input_layernorm(h)
            else:
                h, residual = layer.input_layernorm(h, residual)
            h, residual = layer.post_attention_layernorm(h, residual)
            h = layer.mlp(h)
        outputs.append(model.model.norm(h, residual)[0])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
