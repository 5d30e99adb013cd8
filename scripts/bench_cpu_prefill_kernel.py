"""Times the cpu plugin's prompt-attention kernel against torch's SDPA on one prompt chunk per length, SmolLM2's heads
(9 query / 3 KV heads of 64), block size 16, scattered blocks; the two alternate in one process.

    python scripts/bench_cpu_prefill_kernel.py                      # fresh prompts of 64-1024 tokens, bfloat16
    python scripts/bench_cpu_prefill_kernel.py --dtype float32 --context 256   # chunks after 256 cached tokens

SDPA runs as the backend runs it: on the chunk's own K/V (``is_causal``) for a fresh prompt, over the gathered
blocks with a mask after a context. Prints JSON: per length, the median ms of each and the kernel's speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import engine  # noqa: F401  (before torch: engine sets OpenMP's wait policy before OpenMP starts)

# isort: split
import torch
import torch.nn.functional as F

from engine.worker.heap_policy import apply_heap_policy
from engine_attention_cpu import _C


def case(tokens: int, context: int, dtype: torch.dtype, heads: int, kv_heads: int, head_size: int, block_size: int):
    gen = torch.Generator().manual_seed(tokens + context)
    total = tokens + context
    num_blocks = -(-total // block_size)
    cache = torch.randn(2, num_blocks + 8, kv_heads, block_size, head_size, generator=gen).to(dtype)
    block_ids = torch.randperm(num_blocks + 8, generator=gen)[:num_blocks].long()
    query = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    return query, cache, block_ids


def time_length(tokens: int, context: int, dtype: str, repeats: int, heads: int, kv_heads: int, head_size: int) -> dict:
    """The kernel and SDPA on one chunk of ``tokens`` after ``context`` cached tokens, alternating."""
    block_size, scale, total = 16, head_size**-0.5, tokens + context
    query, cache, block_ids = case(tokens, context, getattr(torch, dtype), heads, kv_heads, head_size, block_size)
    key_cache, value_cache = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    out = torch.empty_like(query)
    # a fresh prompt's K/V as the step has them ([tokens, Hkv, D], also written into the cache)
    positions = torch.arange(tokens)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    new_k, new_v = key_cache.flatten(0, 1)[slots], value_cache.flatten(0, 1)[slots]

    def kernel():
        _C.paged_prefill_attention(out, query, key_cache, value_cache, block_ids, context, scale, 0.0, 0)

    def sdpa():
        q = query.transpose(0, 1).unsqueeze(0)
        if context == 0:
            k, v = new_k.transpose(0, 1).unsqueeze(0), new_v.transpose(0, 1).unsqueeze(0)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        k = cache[0][block_ids].transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :total].unsqueeze(0)
        v = cache[1][block_ids].transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :total].unsqueeze(0)
        keys, positions = torch.arange(total), torch.arange(context, total)
        mask = keys[None, :] <= positions[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    calls = min(200, max(1, 2_000_000 // (tokens * total)))  # a few ms a timing
    runs = {"kernel": kernel, "sdpa": sdpa}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in runs.items():
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - begin) / calls * 1e3)
    kernel_ms, sdpa_ms = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
    return {
        "tokens": tokens,
        "context": context,
        "dtype": dtype,
        "kernel_ms": round(kernel_ms, 4),
        "sdpa_ms": round(sdpa_ms, 4),
        "speedup": round(sdpa_ms / kernel_ms, 3),
    }


def main(
    lengths: list[int], context: int, dtype: str, repeats: int, heads: int = 9, kv_heads: int = 3, head_size: int = 64
) -> list[dict]:
    apply_heap_policy()  # as the CPU worker runs
    return [time_length(tokens, context, dtype, repeats, heads, kv_heads, head_size) for tokens in lengths]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,128,256,512,1024", help="query tokens of each chunk, comma-separated")
    parser.add_argument("--context", type=int, default=0, help="cached tokens before each chunk")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    report = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "results": main([int(x) for x in args.lengths.split(",")], args.context, args.dtype, args.repeats),
    }
    print(json.dumps(report, indent=2))
