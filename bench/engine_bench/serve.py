"""`engine bench serve`: Poisson arrivals of streaming completions against an OpenAI-compatible URL."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Optional

from engine_bench.stats import summarize
from engine_bench.workloads import BenchRequest


async def _one(client, url: str, model: Optional[str], request: BenchRequest, api_key: Optional[str]) -> dict:
    temperature = 0.6 if request.temperature is None else request.temperature
    body = {
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "ignore_eos": request.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    chunk_times, output_tokens, error, refused = [], 0, None, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                refused = response.status_code == 503 and "Retry-After" in response.headers  # bounded admission
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        error = payload["error"]["message"]
                    elif payload.get("choices") and payload["choices"][0].get("text"):
                        chunk_times.append(time.perf_counter())
                    if payload.get("usage"):
                        output_tokens = payload["usage"]["completion_tokens"]
    except Exception as exc:  # a failed request is counted, not fatal
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    ttft = chunk_times[0] - start if chunk_times else None
    return {
        "ok": error is None and bool(chunk_times),
        "refused": refused,
        "error": error,
        "ttft": ttft,
        "e2e": end - start,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "output_tokens": output_tokens,
        "prompt_tokens": request.prompt_len,
        "tpot": (end - start - ttft) / (output_tokens - 1) if ttft is not None and output_tokens > 1 else None,
    }


async def run_serve_bench(
    url: str,
    requests: list[BenchRequest],
    request_rate: float,
    model: Optional[str],
    api_key: Optional[str],
    seed: int = 0,
    max_concurrency: Optional[int] = None,
    slo_ttft_ms: Optional[float] = None,
) -> dict:
    """Send requests with exponential gaps (rate per second; inf = all at once). A multi-turn workload sends
    conversations with those gaps, each conversation's turns one after the other (a turn waits for the
    previous reply). Calls an overloaded server refuses (503 with Retry-After) are counted as ``refused``, not as
    failures. With ``slo_ttft_ms``: ``goodput`` (requests/s that completed with a TTFT within it) and
    ``slo_attained`` (their share of the requests sent)."""
    import httpx

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as client:

        async def limited(turns: list[BenchRequest]) -> list[dict]:
            out = []
            for request in turns:
                async with limit:
                    out.append(await _one(client, url.rstrip("/"), model, request, api_key))
            return out

        conversations: dict[int, list[BenchRequest]] = {}
        for index, request in enumerate(requests):
            key = request.conversation if any(r.turn for r in requests) else index
            conversations.setdefault(key, []).append(request)
        tasks = []
        start = arrival = time.perf_counter()
        for turns in conversations.values():
            tasks.append(asyncio.create_task(limited(sorted(turns, key=lambda r: r.turn))))
            if request_rate != float("inf"):
                # arrivals keep their own clock: time spent sending does not lower the rate offered
                arrival += rng.expovariate(request_rate)
                await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        results = [result for group in await asyncio.gather(*tasks) for result in group]
        duration = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    refused = [r for r in results if r["refused"]]
    output_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    slo: dict = {}
    if slo_ttft_ms is not None:
        good = [r for r in ok if r["ttft"] * 1000 <= slo_ttft_ms]
        slo = {"slo_ttft_ms": slo_ttft_ms, "goodput": len(good) / duration, "slo_attained": len(good) / len(results)}
    return {
        "url": url,
        "num_requests": len(requests),
        "request_rate": request_rate,
        "completed": len(ok),
        "refused": len(refused),
        "failed": len(results) - len(ok) - len(refused),
        "errors": [r["error"] for r in results if not r["ok"] and not r["refused"]][:5],
        **slo,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summarize((r["ttft"] for r in ok), 1000),
        "tpot_ms": summarize((r["tpot"] for r in ok if r["tpot"]), 1000),
        "itl_ms": summarize((x for r in ok for x in r["itl"]), 1000),
        "e2e_ms": summarize((r["e2e"] for r in ok), 1000),
        "ttft_s_all": [r["ttft"] for r in ok],
        "e2e_s_all": [r["e2e"] for r in ok],
    }
