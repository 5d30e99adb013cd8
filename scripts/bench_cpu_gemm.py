"""Times the cpu plugin's packed GEMM against oneDNN's packed product (native's) on SmolLM2's linear
shapes, alternating the two in one process; prints JSON, GFLOP/s per shape (best of the rounds).

    python scripts/bench_cpu_gemm.py              # rows: 2048 (a prompt chunk), 64, 16, 1 (decode steps)
"""

from __future__ import annotations

import json
import time

import engine  # noqa: F401  (before torch: engine sets OpenMP's wait policy before OpenMP starts)

# isort: split
import torch

from engine.model.layers.gemm import PackedLinear
from engine_attention_cpu.gemm import CpuPackedLinear

SHAPES = {
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def gflops(product, x: torch.Tensor, flop: float, seconds: float = 0.5) -> float:
    product(x)
    calls, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        product(x)
        calls += 1
    return flop * calls / (time.perf_counter() - begin) / 1e9


def main(rows=(2048, 64, 16, 1), rounds: int = 3) -> dict:
    gen = torch.Generator().manual_seed(0)
    results = {}
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=gen)
        products = {"cpu": CpuPackedLinear(weight), "onednn": PackedLinear(weight)}
        for m in rows:
            if name == "lm_head" and m > 64:  # logits are computed for the sampled rows only
                continue
            x = torch.randn(m, in_features, generator=gen)
            flop = 2.0 * m * out_features * in_features
            best = {kind: 0.0 for kind in products}
            for _ in range(rounds):
                for kind, product in products.items():
                    best[kind] = max(best[kind], gflops(product, x, flop))
            results[f"{name} {m}x{out_features}x{in_features}"] = {
                **{f"{kind}_gflops": round(value, 1) for kind, value in best.items()},
                "ratio": round(best["cpu"] / best["onednn"], 2),
            }
    return {"threads": torch.get_num_threads(), "shapes": results}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
