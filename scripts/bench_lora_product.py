"""Times the batched LoRA product on SmolLM2's four LoRA layers (q/k/v and gate/up merged, o and down alone), 4
adapter slots of rank 16 with every token on one of them, at several step sizes: the cpu plugin's C++ kernel, the
masked torch form (every slot's shrink for every token, one mask, every slot's expand: three calls a layer) and the
grouped torch reference (one shrink and one expand per slot); alternating them in one process, best of the rounds.
Prints JSON: microseconds per layer, summed over the four layers, per step size and form.

    python scripts/bench_lora_product.py                 # tokens: 1, 16, 64, 128, 256, 512
    python scripts/bench_lora_product.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import engine  # noqa: F401  (before torch: engine sets OpenMP's wait policy before OpenMP starts)

# isort: split
import numpy as np
import torch

from engine.lora.mapping import LoRAMapping
from engine.model.layers.lora_reference import add_lora as add_lora_reference
from engine_attention_cpu.lora import add_lora_kernel, load_lora_ops

# (in, out slices as (offset, size)) of SmolLM2-135M's LoRA layers
LAYERS = {
    "qkv_proj": (576, ((0, 576), (576, 192), (768, 192))),
    "o_proj": (576, ((0, 576),)),
    "gate_up_proj": (576, ((0, 1536), (1536, 1536))),
    "down_proj": (1536, ((0, 576),)),
}
SLOTS, RANK = 4, 16


def masked(y, x, lora_a, lora_b, mapping):
    """The torch form the cpu plugin ran before its C++ kernel: every slot's products for every token."""
    slots, width = mapping.num_slots, lora_a.shape[1]
    a = lora_a[:slots].reshape(slots * width, lora_a.shape[2])
    b = lora_b[:, :slots].reshape(lora_b.shape[0], slots * width)
    shrunk = torch.mm(x.to(a.dtype), a.t())
    slot_mask = (mapping.token_slots.view(-1, 1) == torch.arange(slots).view(1, -1)).to(torch.float32).unsqueeze(-1)
    shrunk = shrunk.view(-1, slots, width).mul_(slot_mask).view(-1, slots * width)
    return y.add_(torch.mm(shrunk, b.t()).to(y.dtype))


def adapter_weights(gen, in_features, slices):
    """Random A and block-diagonal B as LoRALinear holds them."""
    width = len(slices) * RANK
    out = sum(size for _, size in slices)
    lora_a = torch.randn(SLOTS, width, in_features, generator=gen) * 0.05
    lora_b = torch.zeros(out, SLOTS, width)
    for index, (offset, size) in enumerate(slices):
        lora_b[offset : offset + size, :, index * RANK : (index + 1) * RANK] = torch.randn(size, SLOTS, RANK) * 0.05
    return lora_a, lora_b


def seconds_per_call(product, seconds: float = 0.3) -> float:
    product()
    calls, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        product()
        calls += 1
    return (time.perf_counter() - begin) / calls


def main(tokens=(1, 16, 64, 128, 256, 512), dtype=torch.float32, rounds: int = 3) -> dict:
    ops = load_lora_ops()
    gen = torch.Generator().manual_seed(0)
    weights = {name: adapter_weights(gen, k, slices) for name, (k, slices) in LAYERS.items()}
    results: dict = {"dtype": str(dtype).removeprefix("torch."), "isa": torch.backends.cpu.get_cpu_capability()}
    for count in tokens:
        mapping = LoRAMapping.from_token_slots(np.sort(np.arange(count) % SLOTS))  # requests' tokens in runs
        best = {form: float("inf") for form in ("cpp", "masked", "grouped")}
        for _ in range(rounds):
            for form in best:
                total = 0.0
                for name, (k, slices) in LAYERS.items():
                    lora_a, lora_b = weights[name]
                    x = torch.randn(count, k, generator=gen).to(dtype)
                    y = torch.zeros(count, lora_b.shape[0], dtype=dtype)
                    product = {
                        "cpp": functools.partial(add_lora_kernel, ops, y, x, lora_a, lora_b, mapping, slices),
                        "masked": functools.partial(masked, y, x, lora_a, lora_b, mapping),
                        "grouped": functools.partial(add_lora_reference, y, x, lora_a, lora_b, mapping),
                    }[form]
                    total += seconds_per_call(product)
                best[form] = min(best[form], total)
        results[str(count)] = {form: round(seconds * 1e6, 1) for form, seconds in best.items()}
        print(json.dumps({count: results[str(count)]}), flush=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(json.dumps(main(tuple(args.tokens), getattr(torch, args.dtype)), indent=1))
