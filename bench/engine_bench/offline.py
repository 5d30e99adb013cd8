"""Offline benchmarks through LLM: throughput (with A/B of plugin choices) and batch latency,
plus transformers' generate as a peer measured in the same run."""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine_bench.stats import peak_rss_mib, summarize
from engine_bench.workloads import BenchRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRABench:
    """``--lora-adapters N``: random rank-``rank`` adapters of the model (``folders``), one per request in turn."""

    folders: list[str]
    rank: int

    @property
    def label(self) -> str:
        return f"LoRA x{len(self.folders)}"

    @property
    def overrides(self) -> dict[str, Any]:
        return {"lora": {"enable_lora": True, "max_loras": len(self.folders), "max_lora_rank": self.rank}}


def make_lora_bench(base: dict[str, Any], count: int, rank: int, folder: str) -> LoRABench:
    """Write ``count`` random adapters (every projection, ``rank``) of the bench's model into ``folder``."""
    from engine.config import VllmConfig
    from engine.lora.random_adapter import write_random_adapter
    from engine.model.model_info import resolve_model

    hf_config = resolve_model(VllmConfig.load(**base).model).hf_config
    folders = [
        write_random_adapter(hf_config, os.path.join(folder, f"adapter-{i}"), rank=rank, alpha=2 * rank, seed=i)
        for i in range(count)
    ]
    return LoRABench(folders, rank)


# `--structured json-schema`: every request constrained to JSON records, never finished before max_tokens (at least
# 512 records), so the constrained run produces as many tokens as the unconstrained one
BENCH_SCHEMAS = {
    "json-schema": {
        "type": "object",
        "properties": {
            "records": {
                "type": "array",
                "minItems": 512,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0},
                        "name": {"type": "string", "maxLength": 16},
                        "kind": {"enum": ["alpha", "beta", "gamma"]},
                        "score": {"type": "number"},
                    },
                    "required": ["id", "name", "kind", "score"],
                },
            }
        },
        "required": ["records"],
    }
}


def _params(requests: list[BenchRequest], temperature: float, structured: Optional[str] = None):
    from engine import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=BENCH_SCHEMAS[structured]) if structured else None
    # one global seed (model.seed), no per-request seeds: what WORKLOAD.md and the vLLM peer do
    return [
        SamplingParams(
            temperature=temperature if r.temperature is None else r.temperature,
            max_tokens=r.output_len,
            ignore_eos=r.ignore_eos,
            structured_outputs=constraint,
        )
        for r in requests
    ]


def _prompts(requests: list[BenchRequest]) -> list:
    return [{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in requests]


def _first_adapter_request(llm, adapter) -> dict:
    """Time to first token of a request whose adapter the engine has not loaded yet (read from disk into the
    worker's slots), then of the same request once it has."""
    from engine import SamplingParams

    times = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": [11] * 16}], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=adapter
        )
        times.append(time.perf_counter() - start)
    return {"lora_first_request_ttft_s": times[0], "lora_loaded_request_ttft_s": times[1]}


def run_throughput_once(
    overrides: dict[str, Any],
    requests: list[BenchRequest],
    temperature: float,
    structured: Optional[str] = None,
    lora_adapters: Optional[list[str]] = None,
) -> dict:
    """A fresh engine, one warm-up request per engine core (a prompt no workload starts with), then every
    request at once (a multi-turn workload: turn by turn); tokens per second and the prefix-cache hit rate.
    ``structured``: every request constrained (BENCH_SCHEMAS); the grammar's compile time is reported.
    ``lora_adapters``: adapter folders; request ``i`` runs with adapter ``i % len(lora_adapters)`` (the time to first
    token of a request that loads its adapter is reported)."""
    from engine import LLM, LoRARequest, SamplingParams

    start = time.perf_counter()
    llm = LLM(**overrides)
    startup = time.perf_counter() - start
    ranks = llm.llm_engine.vllm_config.parallel.data_parallel_size
    llm.generate(
        [{"prompt_token_ids": [7 + rank] * 16} for rank in range(ranks)], SamplingParams(max_tokens=4), use_tqdm=False
    )
    adapters = [LoRARequest(f"bench-{i}", i + 1, path) for i, path in enumerate(lora_adapters or [])]
    lora_timing = _first_adapter_request(llm, adapters[0]) if adapters else {}
    if len(adapters) > 1:  # every adapter loaded before the clock starts, as the vLLM peer loads its own
        llm.generate(
            [{"prompt_token_ids": [11] * 16}] * (len(adapters) - 1),
            SamplingParams(max_tokens=1),
            use_tqdm=False,
            lora_request=adapters[1:],
        )
    before = llm.get_stats()
    start = time.perf_counter()
    outputs = []
    position = {id(r): i for i, r in enumerate(requests)}
    for turn in sorted({r.turn for r in requests}):  # multi-turn workloads: turn by turn
        batch = [r for r in requests if r.turn == turn]
        outputs += llm.generate(
            _prompts(batch),
            _params(batch, temperature, structured),
            use_tqdm=False,
            lora_request=[adapters[position[id(r)] % len(adapters)] for r in batch] if adapters else None,
        )
    seconds = time.perf_counter() - start
    from engine.testing.inspection import inspect

    try:
        compiles = inspect(llm).structured_output_manager.compile_seconds if structured else None
    except LookupError:  # the engine core runs in another process
        compiles = None
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.get_stats()
    spec = stats.spec_decoding
    llm.shutdown()
    del llm
    gc.collect()
    result = {
        "seconds": seconds,
        "startup_seconds": startup,
        "requests_per_s": len(requests) / seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "peak_rss_mib": peak_rss_mib(),
        **_prefix_cache_fields(before, stats),
        **lora_timing,
    }
    if structured:
        result.update({"structured": structured, "grammar_compile_seconds": max(compiles) if compiles else None})
    if spec is not None:  # counted since start: the warm-up's few tokens are in them
        per_position = spec.num_accepted_tokens_per_pos
        result.update(
            {
                "spec_acceptance_rate": spec.acceptance_rate,
                "spec_mean_acceptance_length": spec.mean_acceptance_length,
                "spec_num_drafts": spec.num_drafts,
                "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_acceptance_per_position": [n / spec.num_drafts if spec.num_drafts else 0.0 for n in per_position],
                "spec_steps_skipped": spec.num_steps_skipped,
            }
        )
    return result


def run_peer_transformers(
    model_info, requests: list[BenchRequest], temperature: float, dtype, batch_size: int = 16
) -> dict:
    """transformers' generate on the same workload: static batches, left padding (shared/bench/peer_hf.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_info.format == "gguf":
        import os

        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_info.path), gguf_file=os.path.basename(model_info.path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_info.path, dtype=dtype)
    model.eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    output_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.tensor([[pad] * (width - r.prompt_len) + list(r.prompt) for r in batch])
            mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch])
            new = max(r.output_len for r in batch)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=temperature > 0,
                temperature=temperature or None,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad,
            )
            output_tokens += sum(r.output_len for r in batch)  # counted as asked, like the shared peer
    seconds = time.perf_counter() - start
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "seconds": seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "requests_per_s": len(requests) / seconds,
        "peak_rss_mib": peak_rss_mib(),
    }


def transformers_peer(model_info, requests: list[BenchRequest], temperature: float, dtype) -> Callable[[], dict]:
    """A runner for transformers' generate on the workload, each run in its own spawned process (so its
    peak resident memory is its own, like the engine's runs)."""
    return lambda: _in_fresh_process(run_peer_transformers, model_info, requests, temperature, dtype)


def _prefix_cache_fields(before, after) -> dict:
    """The measured run's prefix-cache hit rate (tokens), and with data parallelism each rank's share of the
    requests and its own hit rate."""
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    fields = {"prefix_cache_hit_rate": hits / queries if queries else 0.0}
    if after.per_rank:
        pairs = list(zip(before.per_rank, after.per_rank))
        fields["dp_requests_per_rank"] = [a.num_requests_received - b.num_requests_received for b, a in pairs]
        fields["dp_prefix_cache_hit_rate_per_rank"] = [
            (a.prefix_cache_hits - b.prefix_cache_hits) / max(1, a.prefix_cache_queries - b.prefix_cache_queries)
            for b, a in pairs
        ]
    return fields


def _in_fresh_process(fn, *args):
    """Run one measurement in a spawned process: no allocator or thread state carries over between runs,
    and the peak resident memory reported is that run's own. Not a pool worker: those are daemons, which may
    not start the engine-core processes that data parallelism needs."""
    import multiprocessing

    from engine.lifetime import start_process

    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=_run_and_send, args=(os.getpid(), send, fn, *args), name="BenchRun")
    start_process(proc)
    send.close()
    try:
        status, value = receive.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the bench run's process ended without a result (exit code {proc.exitcode})") from None
    proc.join()
    if status == "error":
        raise RuntimeError(f"the bench run failed:\n{value}")
    return value


def _run_and_send(parent_pid: int, conn, fn, *args) -> None:
    import traceback

    from engine.lifetime import watch_parent

    watch_parent(parent_pid, "bench run")  # a killed `engine bench` takes its measurement with it
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_throughput_ab(
    base: dict[str, Any],
    variants: list[tuple[str, dict[str, Any]]],
    requests: list[BenchRequest],
    temperature: float,
    repeats: int,
    peers: Optional[list[tuple[str, Callable[[], dict]]]] = None,
    structured: Optional[str] = None,
    lora: Optional[LoRABench] = None,
) -> list[dict]:
    """Every variant (and peer) ``repeats`` times, alternating (A B A B ...); the (lower) median run of
    each is reported, every run is kept. Peers run in their own processes between the engine's runs.
    ``structured``: each variant also runs with every request constrained, right after its unconstrained run
    (label ``"<variant> + <structured>"``, with ``ratio_to_unconstrained``). ``lora``: each variant also runs with
    every request on one of the adapters (label ``"<variant> + LoRA xN"``, with ``ratio_to_base_model``)."""
    runs_of: list[tuple[str, dict[str, Any], Optional[str], Optional[list[str]]]] = [
        (label, overrides, None, None) for label, overrides in variants
    ]
    if structured:
        runs_of = [
            run
            for label, overrides, _, _ in runs_of
            for run in ((label, overrides, None, None), (f"{label} + {structured}", overrides, structured, None))
        ]
    if lora is not None:
        runs_of = [
            run
            for label, overrides, constraint, _ in runs_of
            for run in (
                (label, overrides, constraint, None),
                (f"{label} + {lora.label}", {**overrides, **lora.overrides}, constraint, lora.folders),
            )
        ]
    variants = [(label, overrides) for label, overrides, _, _ in runs_of]
    runs: dict[str, list[dict]] = {label: [] for label, _ in [*variants, *(peers or [])]}
    for round_index in range(repeats):
        for label, overrides, constraint, folders in runs_of:
            logger.info("bench round %d: %s", round_index + 1, label)
            runs[label].append(
                _in_fresh_process(
                    run_throughput_once, {**base, **overrides}, requests, temperature, constraint, folders
                )
            )
        for label, run_peer in peers or []:
            logger.info("bench round %d: %s", round_index + 1, label)
            runs[label].append(run_peer())
    results = []
    for label, overrides in [*variants, *((label, {"peer": label}) for label, _ in peers or [])]:
        ordered = sorted(runs[label], key=lambda r: r["total_tokens_per_s"])
        median = ordered[(len(ordered) - 1) // 2]  # the lower median: with two runs, the slower one
        results.append(
            {
                "variant": label,
                "config": overrides,
                **median,
                "runs_total_tokens_per_s": [r["total_tokens_per_s"] for r in runs[label]],
            }
        )
    first = results[0]["total_tokens_per_s"]
    by_label = {result["variant"]: result for result in results}
    for result in results:
        result["ratio_to_first"] = result["total_tokens_per_s"] / first
        if result.get("structured"):
            free = by_label[result["variant"].removesuffix(f" + {result['structured']}")]
            result["ratio_to_unconstrained"] = result["total_tokens_per_s"] / free["total_tokens_per_s"]
        if lora is not None and result["variant"].endswith(f" + {lora.label}"):
            plain = by_label[result["variant"].removesuffix(f" + {lora.label}")]
            result["ratio_to_base_model"] = result["total_tokens_per_s"] / plain["total_tokens_per_s"]
    return results


def run_latency(
    overrides: dict[str, Any], batch_size: int, input_len: int, output_len: int, iterations: int, warmup: int
) -> dict:
    """One batch of ``batch_size`` requests, end to end, ``iterations`` times after warm-ups, stepped through the
    engine: the time until every request has its first token (the batch's prefill) and the time per output token
    after it (TPOT: the rest of the run over ``output_len - 1`` steps)."""
    from engine import LLM, SamplingParams
    from engine_bench.workloads import random_workload

    llm = LLM(**overrides)
    engine = llm.llm_engine
    requests = random_workload(batch_size, input_len, output_len)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = _prompts(requests)
    times, prefills, tpots = [], [], []
    for i in range(warmup + iterations):
        llm.reset_prefix_cache()  # every iteration computes its prompts
        start = time.perf_counter()
        waiting = {engine.add_request(prompt, params) for prompt in prompts}
        first_tokens = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id in waiting and output.outputs and output.outputs[0].token_ids:
                    waiting.discard(output.request_id)
            if first_tokens is None and not waiting:
                first_tokens = time.perf_counter()
        end = time.perf_counter()
        if i >= warmup:
            times.append(end - start)
            prefills.append((first_tokens or end) - start)
            if output_len > 1 and first_tokens is not None:
                tpots.append((end - first_tokens) / (output_len - 1))
    llm.shutdown()
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "iterations": iterations,
        "latency_s": summarize(times),
        "latencies_s": times,
        "prefill_s": summarize(prefills),
        "tpot_ms": statistics.median(tpots) * 1000 if tpots else None,
        "peak_rss_mib": peak_rss_mib(),
        "median_s": statistics.median(times),
    }
