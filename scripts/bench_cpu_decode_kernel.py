"""Times the cpu plugin's decode kernel on one 30-layer decode step: 64 requests of 64-700 tokens,
9 query / 3 KV heads of 64 (SmolLM2), block size 16, scattered blocks, one cold cache per layer.

    python scripts/bench_cpu_decode_kernel.py      # prints JSON: ms per step and the KV read rate
    python scripts/bench_cpu_decode_kernel.py --variant avx2 --dtype bfloat16   # one ISA variant, a 16-bit cache
    python scripts/bench_cpu_decode_kernel.py --variant all   # every variant this CPU runs, steps alternating
    python scripts/bench_cpu_decode_kernel.py --warm   # the same rows from one small cache that stays in L2:
                                                       # the arithmetic alone (cold minus warm: the wait on memory)

With several variants the steps alternate (A B A B ...) and each reports its median step: the machine's memory
bandwidth drifts between runs minutes apart, so only variants timed side by side compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import engine  # noqa: F401  (before torch: engine sets OpenMP's wait policy before OpenMP starts)

# isort: split
import torch

from engine_attention_cpu import _C


def main(
    rows: int = 64,
    heads: int = 9,
    kv_heads: int = 3,
    head_size: int = 64,
    block_size: int = 16,
    layers: int = 30,
    repeats: int = 5,
    variant: str = "widest",
    dtype: str = "float32",
    warm: bool = False,
) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 700, (rows,), dtype=torch.int32, generator=gen)
    blocks_per_row = (lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_row.sum()) + 1
    order = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32) + 1
    table = torch.zeros(rows, int(blocks_per_row.max()), dtype=torch.int32)
    start = 0
    for r in range(rows):
        n = int(blocks_per_row[r])
        table[r, :n] = order[start : start + n]
        start += n
    kind = getattr(torch, dtype)
    if warm:  # every layer and request reads the same 48 blocks (600 KB in bfloat16), which stay in L2
        table = table % 48 + 1
        caches = [torch.randn(2, 49, kv_heads, block_size, head_size, generator=gen).to(kind)] * layers
    else:
        caches = [
            torch.randn(2, num_blocks, kv_heads, block_size, head_size, generator=gen).to(kind) for _ in range(layers)
        ]
    query = torch.randn(rows, heads, head_size, generator=gen).to(kind)
    names = [name for name, runs in _C.variants() if runs]
    chosen = {"widest": [-1], "all": list(range(len(names)))}.get(variant) or [names.index(variant)]
    out = torch.empty_like(query)

    def step(index: int) -> float:
        begin = time.perf_counter()
        for cache in caches:
            _C.paged_decode_attention(
                out,
                query,
                cache[0].transpose(1, 2),
                cache[1].transpose(1, 2),
                table,
                lens,
                head_size**-0.5,
                0.0,
                0,
                variant=index,
            )
        return time.perf_counter() - begin

    for index in chosen:
        step(index)  # warm-up
    times: dict[int, list[float]] = {index: [] for index in chosen}
    for _ in range(repeats):
        for index in chosen:
            times[index].append(step(index))
    kv_bytes = float(lens.sum()) * kv_heads * head_size * 2 * caches[0].element_size() * layers
    results = []
    for index in chosen:
        seconds = statistics.median(times[index])
        results.append(
            {
                "variant": variant if index < 0 else names[index],
                "dtype": dtype,
                "caches": "warm" if warm else "cold",
                "ms_per_step": round(seconds * 1e3, 1),
                "kv_read_gb_per_s": round(kv_bytes / seconds / 1e9, 1),
                "threads": torch.get_num_threads(),
            }
        )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="widest", help="an ISA variant (_C.variants()), widest (default) or all")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warm", action="store_true", help="one small cache for every layer: the arithmetic alone")
    args = parser.parse_args()
    repeats = 9 if args.variant == "all" else 5
    for result in main(variant=args.variant, dtype=args.dtype, repeats=repeats, warm=args.warm):
        print(json.dumps(result))
