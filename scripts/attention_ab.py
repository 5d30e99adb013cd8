"""A/B of the attention backends on one machine: greedy parity with the torch backend and throughput
on a shortened W1 workload (random prompts 32-512 tokens, outputs 32-256, temperature 0.6, ignore_eos).

usage: python scripts/attention_ab.py [--backends torch,triton,flash,flashinfer] [--requests 32] [--dtype bfloat16]
Prints one JSON object; backends that cannot run here are listed with their reasons.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len, output_len = rng.randint(32, 512), rng.randint(32, 256)
        out.append(([rng.randint(100, 40000) for _ in range(prompt_len)], output_len))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="torch,triton,flash,flashinfer")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    from engine import LLM, SamplingParams
    from engine.config import VllmConfig
    from engine.interfaces.base import SelectionContext
    from engine.plugins import get_plugin_manager

    impls = get_plugin_manager().implementations("attention")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colors:"]
    requests = workload(args.requests)
    report, reference = {"dtype": args.dtype, "requests": args.requests, "backends": {}}, None
    for name in args.backends.split(","):
        block_size = 256 if name == "flash" else 16
        config = VllmConfig.load(attention=name, block_size=block_size, dtype=args.dtype)
        reasons = impls[name].reasons(SelectionContext(config)) if name in impls else ["not installed"]
        if reasons:
            report["backends"][name] = {"available": False, "reasons": reasons}
            continue
        llm = LLM(attention=name, block_size=block_size, dtype=args.dtype, max_model_len=2048)
        greedy = [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        ]
        reference = reference or greedy
        llm.generate([requests[0][0]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in requests],
            [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for _, o in requests],
            use_tqdm=False,
        )
        seconds = time.perf_counter() - start
        total = sum(len(p) + o for p, o in requests)
        report["backends"][name] = {
            "available": True,
            "greedy_equal_to_first": greedy == reference,
            "greedy_prompts_equal": sum(a == b for a, b in zip(greedy, reference)),
            "seconds": round(seconds, 3),
            "total_tokens_per_s": round(total / seconds, 1),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }
        llm.shutdown()
    first = next((b for b in report["backends"].values() if b.get("available")), None)
    for entry in report["backends"].values():
        if entry.get("available") and first:
            entry["ratio_to_first"] = round(entry["total_tokens_per_s"] / first["total_tokens_per_s"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
