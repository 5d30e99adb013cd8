"""Times MLA decode (absorbed form) over the paged latent cache on one decode step of DeepSeek-V2-Lite's attention
shape (16 heads, latent 512 + 64 rotary dims, block size 16, scattered blocks, a cold cache per layer), for three
implementations of the same operation: the cpu plugin's MLA kernel (csrc/mla_decode.cpp), the cpu plugin's per-head
paged decode kernel given the latent cache as one shared KV head (what the MLA path used first), and the torch
reference (gathered blocks, one SDPA call).

    python scripts/bench_mla_decode.py [--rows 32] [--context 256,1024] [--layers 12] [--dtype float32]

Prints JSON: per context length, ms per step of each implementation and each one's ratio to the MLA kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import engine  # noqa: F401  (before torch: engine sets OpenMP's wait policy before OpenMP starts)

# isort: split
import torch
import torch.nn.functional as F

HEADS, RANK, ROPE, BLOCK = 16, 512, 64, 16


def make_step(rows: int, context: int, layers: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    lens = torch.full((rows,), context, dtype=torch.int32)
    blocks_per_row = -(-context // BLOCK)
    num_blocks = rows * blocks_per_row + 1
    table = (torch.randperm(num_blocks - 1, generator=gen).to(torch.int32) + 1).view(rows, blocks_per_row)
    caches = [torch.randn(num_blocks, BLOCK, RANK + ROPE, generator=gen).to(dtype) for _ in range(layers)]
    query = torch.randn(rows, HEADS, RANK + ROPE, generator=gen).to(dtype)
    return lens, table.contiguous(), caches, query


def mla_kernel(out, query, table, lens, mask, scale, cache):
    from engine_attention_cpu import _mla

    _mla.mla_decode_attention(out, query, cache, table, lens, scale)


def per_head_kernel(out, query, table, lens, mask, scale, cache):
    from engine_attention_cpu import _C

    view = cache.unsqueeze(2)
    _C.paged_decode_attention(out, query, view, view[..., :RANK], table, lens, scale, 0.0, 0)


def torch_reference(out, query, table, lens, mask, scale, cache):
    gathered = cache[table.long()].view(query.shape[0], 1, -1, RANK + ROPE)
    F.scaled_dot_product_attention(
        query.unsqueeze(2), gathered, gathered[..., :RANK], attn_mask=mask, scale=scale, enable_gqa=True
    )


def time_step(run, caches, repeats: int) -> float:
    run(caches[0])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for cache in caches:
            run(cache)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", default="256,1024")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    scale = (128 + ROPE) ** -0.5
    report: dict = {"isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "rows": {}}
    for context in (int(c) for c in args.context.split(",")):
        lens, table, caches, query = make_step(args.rows, context, args.layers, dtype)
        out = query.new_empty(args.rows, HEADS, RANK)
        mask = torch.ones(args.rows, 1, 1, table.shape[1] * BLOCK, dtype=torch.bool)

        step = (out, query, table, lens, mask, scale)
        runs = {
            "mla_kernel": functools.partial(mla_kernel, *step),
            "per_head_kernel": functools.partial(per_head_kernel, *step),
            "torch_reference": functools.partial(torch_reference, *step),
        }
        times = {name: time_step(run, caches, args.repeats) for name, run in runs.items()}
        report["rows"][str(context)] = {
            "ms_per_step": times,
            "ratio_to_mla_kernel": {name: ms / times["mla_kernel"] for name, ms in times.items()},
            "latent_gb_per_s": args.layers
            * args.rows
            * context
            * (RANK + ROPE)
            * query.element_size()
            / (times["mla_kernel"] / 1e3)
            / 1e9,
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
