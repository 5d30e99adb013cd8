"""Benchmark workloads: W1 (the project's shared workload), W2 (input-grounded, for speculative decoding),
random, or a JSONL file of prompts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class BenchRequest:
    prompt: Any  # token ids (list[int]) or text
    prompt_len: int
    output_len: int
    temperature: Optional[float] = None  # None: the bench's --temperature
    ignore_eos: bool = True
    turn: int = 0  # multi-turn workloads: offline, turn t starts once every request of turn t - 1 finished;
    conversation: int = 0  # served, each conversation sends its turns one after the other


# W2 (shared/bench/WORKLOAD.md): sources of standard-library functions, to be repeated with one change
W2_FUNCTIONS = [
    "textwrap:dedent",
    "textwrap:indent",
    "shlex:quote",
    "json:dumps",
    "json:loads",
    "difflib:get_close_matches",
    "calendar:monthrange",
    "glob:escape",
    "fnmatch:translate",
    "shutil:copyfileobj",
    "shutil:which",
    "base64:b64encode",
    "string:capwords",
    "heapq:nlargest",
    "heapq:nsmallest",
    "colorsys:rgb_to_hsv",
]


def w2_prompts() -> list[str]:
    """W2's 16 prompt texts, built from this Python's standard library as the shared workload builds them."""
    import importlib
    import inspect

    prompts = []
    for name in W2_FUNCTIONS:
        module, function = name.split(":")
        source = inspect.getsource(getattr(importlib.import_module(module), function))
        prompts.append(
            f"```python\n{source}```\n\nThe same function, unchanged except for one extra comment line "
            f"at its top:\n```python\n"
        )
    return prompts


def w2(tokenizer, num_requests: Optional[int] = None, max_tokens: int = 256) -> list[BenchRequest]:
    """W2: greedy, 256 output tokens at most, stopping at EOS (no ignore_eos)."""
    return [
        BenchRequest(text, len(tokenizer.encode(text)), max_tokens, temperature=0.0, ignore_eos=False)
        for text in w2_prompts()[:num_requests]
    ]


def w1(num_requests: int = 64, seed: int = 0) -> list[BenchRequest]:
    """W1 (shared/bench/WORKLOAD.md): prompt 32-512 random ids in [100, 40000], output 32-256, seed 0."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(32, 512), rng.randint(32, 256)
        requests.append(BenchRequest([rng.randint(100, 40000) for _ in range(prompt_len)], prompt_len, output_len))
    return requests


def chat_workload(
    num_conversations: int = 16, num_turns: int = 6, seed: int = 0, vocab: tuple[int, int] = (100, 40000)
) -> list[BenchRequest]:
    """Multi-turn chat replayed: each conversation's turn t resends its history (every earlier user message and
    recorded reply) plus a new user message of 32-96 tokens, and asks for a reply of 32-64 tokens. Turns run
    in order, so a turn's history can come from the prefix cache of the rank that served the previous turn."""
    rng = random.Random(seed)
    requests = []
    histories: list[list[int]] = [[] for _ in range(num_conversations)]
    for turn in range(num_turns):
        for conversation, history in enumerate(histories):
            history.extend(rng.randint(*vocab) for _ in range(rng.randint(32, 96)))
            reply_len = rng.randint(32, 64)
            requests.append(BenchRequest(list(history), len(history), reply_len, turn=turn, conversation=conversation))
            history.extend(rng.randint(*vocab) for _ in range(reply_len))  # the recorded reply
    return requests


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    vocab: tuple[int, int] = (100, 40000),
) -> list[BenchRequest]:
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
    if name == "chat":
        return chat_workload(args.num_prompts or 16, getattr(args, "num_turns", 6), args.workload_seed)
    if name == "random":
        return random_workload(
            args.num_prompts or 64, args.input_len, args.output_len, args.range_ratio, args.workload_seed
        )
    if tokenizer is None:
        from engine.config import VllmConfig
        from engine.model.model_info import resolve_model
        from engine.model.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(resolve_model(VllmConfig.load(model=getattr(args, "model", None)).model))
    if name == "w2":
        return w2(tokenizer, args.num_prompts)
    return jsonl_workload(name, tokenizer, args.output_len, args.num_prompts)
