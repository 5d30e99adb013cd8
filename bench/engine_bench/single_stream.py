"""Single-stream speed as llama.cpp's ``llama-bench`` reports it: prompt processing of ``input_len`` tokens (pp) and
generation of ``output_len`` tokens one at a time (tg), for the engine and, side by side, for ``llama-bench`` run
on the same GGUF file with the same lengths and threads."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from engine_bench.peers import run_watched
from engine_bench.stats import peak_rss_mib


def run_single_stream(
    overrides: dict[str, Any], input_len: int, output_len: int, iterations: int, depth: int = 0
) -> dict:
    """The engine's pp (tokens/s of an ``input_len`` prompt, to its first token) and tg (tokens/s of ``output_len``
    greedy tokens after a 16-token prompt, the prompt's time taken out), the median of ``iterations`` runs. With
    ``depth`` (llama-bench's ``-d``), both run after a context of ``depth`` tokens: pp is the prompt's tokens over the
    time they add to the context's, tg the tokens after the context (the context's own time taken out)."""
    from engine import LLM, SamplingParams
    from engine_bench.workloads import random_workload

    llm = LLM(**overrides)
    context = random_workload(1, depth, 1, seed=2)[0].prompt if depth else []
    long_prompt = {"prompt_token_ids": context + random_workload(1, input_len, 1)[0].prompt}
    short_prompt = {"prompt_token_ids": context or random_workload(1, 16, 1, seed=1)[0].prompt}

    def timed(prompt, max_tokens: int) -> float:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    from engine.testing import inspect
    from engine_bench.bandwidth import model_bytes_per_token

    model = inspect(llm).model
    bytes_per_token = model_bytes_per_token(model) if model is not None else None
    runner = inspect(llm).model_runner
    # K and V bytes one context position takes in all attention layers (as the cache holds them: kv_cache_dtype)
    kv_bytes_per_position = (
        sum(spec.page_size_bytes // spec.block_size for spec in runner.get_kv_cache_spec().values() if _attention(spec))
        if runner is not None
        else None
    )
    timed(short_prompt, 8)  # warm-up: first-call allocations
    pp, tg = [], []
    for _ in range(iterations):
        first_token = timed(short_prompt, 1)
        prompt_time = timed(long_prompt, 1) - (first_token if depth else 0.0)
        pp.append(input_len / max(1e-9, prompt_time))
        tg.append(output_len / max(1e-9, timed(short_prompt, output_len + 1) - first_token))
    llm.shutdown()
    return {
        "prompt_tok_s": round(statistics.median(pp), 1),
        "decode_tok_s": round(statistics.median(tg), 1),
        "prompt_runs": [round(v, 1) for v in pp],
        "decode_runs": [round(v, 1) for v in tg],
        "peak_rss_mib": peak_rss_mib(),
        "bytes_per_token": bytes_per_token,
        "kv_bytes_per_position": kv_bytes_per_position,
        # the mean context a generated token attends (after the 16-token prompt, or after the depth)
        "tg_mean_positions": (depth or len(short_prompt["prompt_token_ids"])) + (output_len + 1) / 2,
    }


def _attention(spec) -> bool:
    """A KV-cache spec of attention (K/V rows per position), not a Mamba layer's constant state."""
    from engine.kv_cache.spec import FullAttentionSpec

    return isinstance(spec, FullAttentionSpec)


def run_llama_bench(
    binary: str,
    model: str,
    input_len: int,
    output_len: int,
    threads: int,
    repetitions: int = 5,
    timeout_s: float = 1800,
    depth: int = 0,
) -> dict:
    """``llama-bench -m model -t threads -p input_len -n output_len -r repetitions -o jsonl`` (and ``-d depth``): its
    pp and tg tokens/s (mean over its repetitions) and the peak resident memory of its process."""
    for path, flag in ((binary, "--peer-binary"), (model, "--peer-model")):
        if not path or not os.path.exists(path):
            raise ValueError(f"{flag}: {path!r} does not exist")
    if not model.endswith(".gguf"):
        raise ValueError(f"--peer-model: llama.cpp reads GGUF files, got {model}")
    command = [
        binary,
        "-m",
        model,
        "-t",
        str(threads),
        "-p",
        str(input_len),
        "-n",
        str(output_len),
        "-r",
        str(repetitions),
        "-o",
        "jsonl",
        *(["-d", str(depth)] if depth else []),
    ]
    lines, peak = run_watched(command, timeout_s=timeout_s, poll_s=0.2)
    rows = [json.loads(line) for line in lines]
    result: dict[str, Any] = {"command": " ".join(command), "peak_rss_mib": round(peak / 2**20, 1)}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_gen"):
            result["prompt_tok_s"] = round(float(row["avg_ts"]), 1)
        elif row.get("n_gen") and not row.get("n_prompt"):
            result["decode_tok_s"] = round(float(row["avg_ts"]), 1)
            result["tg_mean_positions"] = depth + (output_len + 1) / 2
        for cache_type in ("type_k", "type_v"):  # its KV cache's types (f16 unless told)
            if row.get(cache_type):
                result.setdefault(cache_type, row[cache_type])
        result.setdefault("build", row.get("build_commit"))
        result.setdefault("model_type", row.get("model_type"))
    return result


def compare(engine: dict, peer: dict) -> dict:
    """engine / llama.cpp for pp and tg."""
    return {
        f"{key}_ratio": round(engine[key] / peer[key], 2) for key in ("prompt_tok_s", "decode_tok_s") if peer.get(key)
    }
