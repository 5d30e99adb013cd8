"""Kernel-level attention checks: a backend against a float64 reference on random paged batches (mixed
prefill / decode, chunks after cached prefixes, GQA / MQA, sliding window, soft-capping, block sizes)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from engine.interfaces.attention import AttentionBackend, CommonAttentionMetadata

VARIANTS = {"plain": (None, None), "window": (24, None), "softcap": (None, 30.0)}  # (sliding window, soft cap)


def unsupported(backend: type[AttentionBackend], block_size: int, variant: str) -> Optional[str]:
    """Why ``backend`` declares it cannot run this case (None: it must pass it)."""
    sliding_window, soft_cap = VARIANTS[variant]
    if (sliding_window and not backend.supports_sliding_window) or (soft_cap and not backend.supports_logits_soft_cap):
        return f"{backend.name} does not support {variant}"
    if backend.supported_block_sizes and block_size not in backend.supported_block_sizes:
        return f"{backend.name} does not support block size {block_size}"
    return None


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
        block_table[row, : len(table)] = table
    positions = np.concatenate([np.arange(c, c + q) for c, q in shapes])
    rows = np.repeat(np.arange(len(shapes)), query_lens)
    slots = block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = context_lens + query_lens
    common = CommonAttentionMetadata(
        torch.from_numpy(qsl.astype(np.int32)),
        torch.from_numpy(seq_lens.astype(np.int32)),
        torch.from_numpy(context_lens.astype(np.int32)),
        torch.from_numpy(block_table),
        torch.from_numpy(slots),
        int(query_lens.max()),
        int(seq_lens.max()),
        qsl,
        seq_lens,
        context_lens,
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(k_full, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(v_full, shapes)])
    return dict(
        common=common,
        cache=cache.to(device),
        q=torch.cat(q_new),
        k=new_k,
        v=new_v,
        shapes=shapes,
        k_full=k_full,
        v_full=v_full,
        q_list=q_new,
    )


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
            scores = torch.einsum("hd,khd->hk", q[i].double(), k[start : pos + 1]) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            outputs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[start : pos + 1]))
    return torch.stack(outputs)


def check_backend(
    backend: type[AttentionBackend],
    device: str,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    variant: str,
    dtype: torch.dtype,
    head_size: int = 64,
    cache_dtype: Optional[torch.dtype] = None,
) -> None:
    """AssertionError unless ``backend`` gives the reference's outputs on the case and writes the new K/V
    into their cache slots. ``cache_dtype`` (cache.kv_cache_dtype, a 16-bit cache under float32 queries): the cache
    holds every K/V row rounded to it, the new rows must land rounded as torch's ``.to`` rounds, and the outputs must
    be the reference's over the rounded rows at float32's tolerance."""
    sliding_window, soft_cap = VARIANTS[variant]
    backend_name = backend.name
    cache_dtype = cache_dtype or dtype
    case = make_case(block_size + num_heads, block_size, num_heads, num_kv_heads, head_size, cache_dtype, device)
    if cache_dtype != dtype:  # attention reads the rows as the cache holds them
        case["k_full"] = [k.to(cache_dtype).float() for k in case["k_full"]]
        case["v_full"] = [v.to(cache_dtype).float() for v in case["v_full"]]
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
    out = impl.forward(
        case["q"].to(device, dtype).reshape(tokens, -1),
        case["k"].to(device, dtype).reshape(tokens, -1),
        case["v"].to(device, dtype).reshape(tokens, -1),
        case["cache"],
        metadata,
    )
    expected = reference(case, scale, num_heads, num_kv_heads, sliding_window, soft_cap)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        out.view(tokens, num_heads, head_size).double().cpu(), expected, atol=tolerance, rtol=tolerance
    )
    # the new K/V landed in their slots
    slots = case["common"].slot_mapping.to(device)
    key_cache = case["cache"][0].transpose(1, 2) if head_major else case["cache"][0]
    cached_k = key_cache.reshape(-1, num_kv_heads, head_size)[slots]
    if cache_dtype != dtype:
        assert torch.equal(cached_k.cpu(), case["k"].to(cache_dtype)), f"{backend_name}: new keys not rounded as .to"
    torch.testing.assert_close(cached_k.float().cpu(), case["k"].to(dtype).to(cache_dtype).float())


MLA_DIMS = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=16)


def check_mla_backend(
    backend: type[AttentionBackend], device: str, block_size: int, dtype: torch.dtype, num_heads: int = 5
) -> None:
    """AssertionError unless ``backend``'s MLA implementation gives the float64 expanded-form reference on a mixed
    batch (prefills, decodes, chunks after cached prefixes) and writes each new latent row into its cache slot."""
    impl_cls = backend.get_mla_impl_cls()
    assert impl_cls is not None, f"{backend.name} serves no MLA"
    rank, nope, rope, v_dim = (
        MLA_DIMS[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    latent = rank + rope
    # the same requests as the per-head check; one "KV head" of latent rows stands for each token's K and V
    case = make_case(block_size + num_heads, block_size, num_heads, 1, latent, dtype, "cpu")
    gen = torch.Generator().manual_seed(block_size)
    w_kv_b = torch.randn(num_heads * (nope + v_dim), rank, generator=gen) / rank**0.5
    queries = [torch.randn(q.shape[0], num_heads, nope + rope, generator=gen) for q in case["q_list"]]
    num_blocks = case["cache"].shape[1]
    layout = backend.get_mla_kv_cache_shape(num_blocks, block_size, latent)
    assert layout == (num_blocks, block_size, latent), f"{backend.name}: test knows no MLA cache layout {layout}"
    cache = case["cache"][0, :, :, 0].contiguous().to(device)  # the cached prefixes' latent rows
    scale = 1 / math.sqrt(nope + rope)
    impl = impl_cls(num_heads, scale, rank, nope, rope, v_dim, w_kv_b.to(device, dtype), {})
    metadata = backend.get_builder_cls()({}, torch.device(device), block_size).build(case["common"])
    new_latents = case["k"][:, 0]
    tokens = new_latents.shape[0]
    out = impl.forward(
        torch.cat(queries).to(device, dtype),
        new_latents[:, :rank].to(device, dtype).contiguous(),
        new_latents[:, rank:].to(device, dtype).contiguous(),
        cache,
        metadata,
    )
    expected = []
    w = w_kv_b.double().view(num_heads, nope + v_dim, rank)
    for (context, query), rows, q in zip(case["shapes"], case["k_full"], queries):
        rows = rows[:, 0].to(dtype).double()  # what the cache holds
        kv = torch.einsum("hcr,sr->shc", w, rows[:, :rank])
        keys = torch.cat([kv[..., :nope], rows[:, None, rank:].expand(-1, num_heads, rope)], -1)
        for i in range(query):
            pos = context + i
            scores = torch.einsum("hd,shd->hs", q[i].to(dtype).double(), keys[: pos + 1]) * scale
            expected.append(torch.einsum("hs,shv->hv", scores.softmax(-1), kv[: pos + 1, :, nope:]))
    tolerance = 2e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        out.view(tokens, num_heads, v_dim).double().cpu(), torch.stack(expected), atol=tolerance, rtol=tolerance
    )
    slots = case["common"].slot_mapping.to(device)
    torch.testing.assert_close(cache.view(-1, latent)[slots].float().cpu(), new_latents.to(dtype).float())
