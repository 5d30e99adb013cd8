"""Benchmark workloads: W1 (the project's shared workload), random, or a JSONL file of prompts."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional


@dataclass
class BenchRequest:
    prompt: object  # token ids (list[int]) or text
    prompt_len: int
    output_len: int


def w1(num_requests: int = 64, seed: int = 0) -> list[BenchRequest]:
    """W1 (shared/bench/WORKLOAD.md): prompt 32-512 random ids in [100, 40000], output 32-256, seed 0."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(32, 512), rng.randint(32, 256)
        requests.append(BenchRequest([rng.randint(100, 40000) for _ in range(prompt_len)], prompt_len, output_len))
    return requests


def random_workload(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> list[BenchRequest]:
    """Random token ids; lengths drawn uniformly within ±range_ratio of the given ones."""
    rng = random.Random(seed)
    spread = lambda n: rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))
    requests = []
    for _ in range(num_requests):
        prompt_len, out_len = spread(input_len), spread(output_len)
        requests.append(BenchRequest([rng.randint(*vocab) for _ in range(prompt_len)], prompt_len, out_len))
    return requests


def jsonl_workload(path: str, tokenizer, default_output_len: int, limit: Optional[int] = None) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": "...", "output_len": N} (output_len optional)."""
    requests = []
    with open(path) as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                ids = tokenizer.encode(item["prompt"])
                requests.append(BenchRequest(item["prompt"], len(ids), int(item.get("output_len", default_output_len))))
            if limit and len(requests) >= limit:
                break
    return requests


def make_workload(name: str, args, tokenizer=None) -> list[BenchRequest]:
    if name == "w1":
        return w1(args.num_prompts or 64)
    if name == "random":
        return random_workload(args.num_prompts or 64, args.input_len, args.output_len, args.range_ratio, args.workload_seed)
    if tokenizer is None:
        from engine.config import VllmConfig
        from engine.model.model_info import resolve_model
        from engine.model.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(resolve_model(VllmConfig.load(model=args.model).model))
    return jsonl_workload(name, tokenizer, args.output_len, args.num_prompts)
