"""Kernel-level parity: every attention backend against a float64 reference on random paged batches
(mixed prefill / decode, prefix hits, GQA / MQA, sliding window, soft-capping, block sizes 16 and 32)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import VllmConfig
from engine.interfaces.attention import CommonAttentionMetadata
from engine.interfaces.base import SelectionContext
from engine.plugins import get_plugin_manager

BACKENDS = ["torch", "cpu", "triton", "flash", "flashinfer"]


def backend_or_skip(name: str, device: str):
    impls = get_plugin_manager().implementations("attention")
    if name not in impls:
        pytest.skip(f"attention backend '{name}' is not installed")
    reasons = impls[name].reasons(SelectionContext(VllmConfig.load(device=device, block_size=16)))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    return impls[name].cls


def make_case(seed: int, block_size: int, num_heads: int, num_kv_heads: int, head_size: int, dtype, device):
    """Requests as (context_len, query_len): decodes, fresh prefills and chunks after cached prefixes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(0, 37), (21, 1), (64, 1), (40, 13), (0, 1), (97, 30), (15, 1)]
    num_blocks = 64
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, k_full, v_full, q_new = [], [], [], []
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    for context, query in shapes:
        total = context + query
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks)
        k = torch.randn(total, num_kv_heads, head_size, generator=gen)
        v = torch.randn(total, num_kv_heads, head_size, generator=gen)
        for pos in range(context):  # the cached prefix is already in the paged cache
            cache[0, blocks[pos // block_size], pos % block_size] = k[pos].to(dtype)
            cache[1, blocks[pos // block_size], pos % block_size] = v[pos].to(dtype)
        k_full.append(k)
        v_full.append(v)
        q_new.append(torch.randn(query, num_heads, head_size, generator=gen))
    query_lens = np.array([q for _, q in shapes])
    context_lens = np.array([c for c, _ in shapes])
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    max_blocks = max(len(t) for t in tables)
    block_table = np.zeros((len(shapes), max_blocks), dtype=np.int32)
    for row, table in enumerate(tables):
        block_table[row, :len(table)] = table
    positions = np.concatenate([np.arange(c, c + q) for c, q in shapes])
    rows = np.repeat(np.arange(len(shapes)), query_lens)
    slots = block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = context_lens + query_lens
    common = CommonAttentionMetadata(
        torch.from_numpy(qsl.astype(np.int32)), torch.from_numpy(seq_lens.astype(np.int32)),
        torch.from_numpy(context_lens.astype(np.int32)), torch.from_numpy(block_table), torch.from_numpy(slots),
        int(query_lens.max()), int(seq_lens.max()), qsl, seq_lens, context_lens)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(k_full, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(v_full, shapes)])
    return dict(common=common, cache=cache.to(device), q=torch.cat(q_new), k=new_k, v=new_v, shapes=shapes,
                k_full=k_full, v_full=v_full, q_list=q_new)


def reference(case, scale, num_heads, num_kv_heads, sliding_window, soft_cap):
    """Dense float64 attention of each new token over its request's keys up to its own position."""
    outputs = []
    group = num_heads // num_kv_heads
    for (context, query), k, v, q in zip(case["shapes"], case["k_full"], case["v_full"], case["q_list"]):
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        for i in range(query):
            pos = context + i
            start = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            scores = torch.einsum("hd,khd->hk", q[i].double(), k[start:pos + 1]) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            outputs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[start:pos + 1]))
    return torch.stack(outputs)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_reference(backend_name, block_size, heads, variant, dtype):
    device = "cuda" if backend_name in ("flash", "flashinfer") else "cpu"
    backend = backend_or_skip(backend_name, device)
    num_heads, num_kv_heads = heads
    head_size = 64
    sliding_window = 24 if variant == "window" else None
    soft_cap = 30.0 if variant == "softcap" else None
    if (sliding_window and not backend.supports_sliding_window) or (soft_cap and not backend.supports_logits_soft_cap):
        pytest.skip(f"{backend_name} does not support {variant}")
    if backend.supported_block_sizes and block_size not in backend.supported_block_sizes:
        pytest.skip(f"{backend_name} does not support block size {block_size}")
    if backend_name == "triton" and device == "cpu" and (dtype != torch.float32 or block_size != 16) and (
            variant != "plain" or heads != (6, 2)):
        pytest.skip("interpreted kernels: the full matrix runs on GPUs; the CPU runs every variant once "
                    "and the other dtype / block size on the plain GQA case")
    case = make_case(block_size + num_heads, block_size, num_heads, num_kv_heads, head_size, dtype, device)
    canonical = case["cache"].shape  # [2, blocks, block_size, kv_heads, head_size]
    layout = backend.get_kv_cache_shape(canonical[1], block_size, num_kv_heads, head_size)
    head_major = layout == (canonical[0], canonical[1], num_kv_heads, block_size, head_size)
    assert layout == canonical or head_major, f"{backend_name}: test knows no cache layout {layout}"
    if head_major:
        case["cache"] = case["cache"].transpose(2, 3).contiguous()
    scale = 1 / math.sqrt(head_size)
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, sliding_window, soft_cap, {})
    builder = backend.get_builder_cls()({}, torch.device(device), block_size, sliding_window)
    metadata = builder.build(case["common"])
    tokens = case["q"].shape[0]
    out = impl.forward(case["q"].to(device, dtype).reshape(tokens, -1), case["k"].to(device, dtype).reshape(tokens, -1),
                       case["v"].to(device, dtype).reshape(tokens, -1), case["cache"], metadata)
    expected = reference(case, scale, num_heads, num_kv_heads, sliding_window, soft_cap)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.view(tokens, num_heads, head_size).double().cpu(), expected,
                               atol=tolerance, rtol=tolerance)
    # the new K/V landed in their slots
    slots = case["common"].slot_mapping.to(device)
    key_cache = case["cache"][0].transpose(1, 2) if head_major else case["cache"][0]
    cached_k = key_cache.reshape(-1, num_kv_heads, head_size)[slots]
    torch.testing.assert_close(cached_k.float().cpu(), case["k"].to(dtype).float())


def test_plugins_table_on_this_machine():
    from engine.interfaces.base import SelectionContext

    rows = {r["name"]: r for r in get_plugin_manager().table(SelectionContext(VllmConfig.load()))
            if r["kind"] == "attention"}
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
    prompts = ["The capital of France is", "def add(a, b):"]
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(dtype="float32", attention=backend, kv_cache_memory="64MiB", max_model_len=512)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outputs]
        llm.shutdown()
    assert results["triton"] == results["torch"]
