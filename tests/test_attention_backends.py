"""Kernel-level parity: every built-in attention backend against a float64 reference on random paged batches
(mixed prefill / decode, prefix hits, GQA / MQA, sliding window, soft-capping, block sizes 16 and 32), with
the checks of the conformance kit (engine.testing.attention)."""

from __future__ import annotations

import pytest
import torch

from engine.config import VllmConfig
from engine.interfaces.base import SelectionContext
from engine.plugins import get_plugin_manager
from engine.testing.attention import check_backend, check_mla_backend, unsupported

BACKENDS = ["torch", "cpu", "triton", "flash", "flashinfer"]


def backend_or_skip(name: str, device: str):
    impls = get_plugin_manager().implementations("attention")
    if name not in impls:
        pytest.skip(f"attention backend '{name}' is not installed")
    reasons = impls[name].reasons(SelectionContext(VllmConfig.load(device=device, block_size=16)))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    return impls[name].cls


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_reference(backend_name, block_size, heads, variant, dtype):
    device = "cuda" if backend_name in ("flash", "flashinfer") else "cpu"
    backend = backend_or_skip(backend_name, device)
    why_not = unsupported(backend, block_size, variant)
    if why_not:
        pytest.skip(why_not)
    if backend_name == "triton" and device == "cpu":
        case = (variant, heads, dtype, block_size)
        gqa, mqa, fp32, bf16 = (6, 2), (4, 1), torch.float32, torch.bfloat16
        interpreted = {
            *((v, gqa, fp32, 16) for v in ("plain", "window", "softcap")),
            ("plain", mqa, fp32, 16),
            ("plain", gqa, bf16, 16),
            ("plain", gqa, fp32, 32),
        }
        if case not in interpreted:
            pytest.skip(
                "interpreted kernels: the full matrix runs on GPUs; the CPU runs every variant on GQA, the plain case "
                "on MQA, in bfloat16 and at block size 32"
            )
    check_backend(backend, device, block_size, *heads, variant, dtype)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16-cache", "fp16-cache"])
def test_a_16_bit_cache_under_float32_queries_matches_the_reference(backend_name, cache_dtype):
    """cache.kv_cache_dtype: each backend that declares a 16-bit cache under a float32 model (its
    ``supported_kv_cache_dtypes``) rounds the new rows into it and attends over the rounded rows in float32."""
    backend = backend_or_skip(backend_name, "cpu")
    if cache_dtype not in backend.supported_kv_cache_dtypes:
        pytest.skip(f"{backend_name} keeps no {cache_dtype} cache under a float32 model")
    heads = (6, 2)
    for variant in ("plain",) if backend_name == "triton" else ("plain", "window", "softcap"):  # triton: interpreted
        check_backend(backend, "cpu", 16, *heads, variant, torch.float32, cache_dtype=cache_dtype)


def test_plugins_table_on_this_machine():
    from engine.interfaces.base import SelectionContext

    rows = {
        r["name"]: r
        for r in get_plugin_manager().table(SelectionContext(VllmConfig.load()))
        if r["kind"] == "attention"
    }
    assert rows["torch"]["available"] == "yes" and rows["triton"]["available"] == "yes"
    if not torch.cuda.is_available():
        for name in ("flash", "flashinfer"):
            assert rows[name]["available"] == "no" and "no CUDA device" in rows[name]["reason"]


def test_auto_never_picks_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("on CUDA auto picks a GPU backend")
    ctx = SelectionContext(VllmConfig.load())
    cpu_built = not get_plugin_manager().implementations("attention")["cpu"].reasons(ctx)
    assert get_plugin_manager().select("attention", "auto", ctx).name == ("cpu" if cpu_built else "torch")


@pytest.mark.slow  # the real SmolLM2 weights
def test_smollm2_greedy_with_triton_equals_torch():
    """End to end through the Triton kernels (interpreted here): a short run on the real model."""
    from engine import LLM, SamplingParams

    backend_or_skip("triton", "cpu")
    prompts = ["The capital of France is"]  # a prefill and a decode step through 30 interpreted layers
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(dtype="float32", quantization="none", attention=backend, kv_cache_memory="64MiB", max_model_len=512)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outputs]
        llm.shutdown()
    assert results["triton"] == results["torch"]


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_backend_matches_reference(backend_name, block_size, dtype):
    """MLA: decode rows absorbed over the latent cache, prompt chunks expanded, against float64."""
    backend = backend_or_skip(backend_name, "cpu")
    if backend_name == "triton" and (dtype != torch.float32 or block_size != 16):
        pytest.skip("interpreted kernels: the CPU runs the float32, block-size-16 case")
    check_mla_backend(backend, "cpu", block_size, dtype)


def test_backends_say_whether_they_serve_mla():
    rows = {r["name"]: r for r in get_plugin_manager().table(SelectionContext(VllmConfig.load())) if "mla" in r}
    assert rows["torch"]["mla"] == "yes" and rows["triton"]["mla"] == "yes"
    assert rows["flash"]["mla"].startswith("no: ") and rows["flashinfer"]["mla"].startswith("no: ")
