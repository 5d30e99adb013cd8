"""Times the cpu plugin's decode kernel on one 30-layer decode step: 64 requests of 64-700 tokens,
9 query / 3 KV heads of 64 (SmolLM2), block size 16, scattered blocks, one cold cache per layer.

    python scripts/bench_cpu_decode_kernel.py      # prints JSON: ms per step and the KV read rate
"""

from __future__ import annotations

import json
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
) -> dict:
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
    caches = [torch.randn(2, num_blocks, kv_heads, block_size, head_size, generator=gen) for _ in range(layers)]
    query = torch.randn(rows, heads, head_size, generator=gen)
    out = torch.empty_like(query)

    def step():
        for cache in caches:
            _C.paged_decode_attention(
                out, query, cache[0].transpose(1, 2), cache[1].transpose(1, 2), table, lens, head_size**-0.5, 0.0, 0
            )

    step()
    begin = time.perf_counter()
    for _ in range(repeats):
        step()
    seconds = (time.perf_counter() - begin) / repeats
    kv_bytes = float(lens.sum()) * kv_heads * head_size * 2 * 4 * layers
    return {
        "ms_per_step": round(seconds * 1e3, 1),
        "kv_read_gb_per_s": round(kv_bytes / seconds / 1e9, 1),
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
