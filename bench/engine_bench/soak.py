"""`engine bench soak`: a long run of mixed traffic against `engine serve`, watching its processes for leaks.

Requests arrive as a Poisson process at the given rate, drawn from W1 in turn: half streaming, half not; one in
20 is a stream the client drops after a few chunks; one in 50 is hostile (a body the server must refuse with
400). Every few seconds the bench samples the server's processes (the API server, engine cores, workers,
coordinator: RSS, open file descriptors, threads) and its /metrics (KV-cache usage, requests running and
waiting). At the end it waits for the server to drain and checks every KV block came back.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from engine_bench.workloads import BenchRequest

CANCEL_EVERY = 20
HOSTILE_EVERY = 50
# where in its cycle each kind falls: early, so that even a short run holds one of each
CANCEL_AT, HOSTILE_AT = 4, 9
# bodies the server must refuse with 400 (raw JSON text: some are not valid JSON on purpose)
HOSTILE_BODIES = (
    '{"prompt": [1000000000], "max_tokens": 4}',  # a token id past the vocabulary
    '{"prompt": "hello", "max_tokens": -3}',
    '{"prompt": "hello", "max_tokens": 4, "temperature": NaN}',
    '{"prompt": "hello", "max_tokens": 4',  # cut short
    '{"prompt": "hello", "max_tokens": 4, "logit_bias": {"not-a-token": 5}}',
    '{"prompt": "hello", "max_tokens": 4, "n": 100000}',
    '{"prompt": "hello", "max_tokens": 100000000}',  # past the context
    '{"prompt": "hello", "max_tokens": 4, "stop": [{"x": 1}]}',
)
# targets after warm-up (issue 38): RSS growth below 5%; descriptors and threads flat (a few connections of
# requests in flight at the moment of a sample are not a leak); no error but the intended ones; every KV block
# back at the end
RSS_GROWTH_LIMIT = 0.05
FD_SLACK = 8
THREAD_SLACK = 4


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m`` or ``2h``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise ValueError(f"--duration {text!r}: expected a number with s, m or h (30m)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


@dataclass
class SoakCounts:
    """What the clients saw. ``unexpected``: every outcome that is not one of the intended ones."""

    completed: int = 0
    streamed: int = 0
    cancelled: int = 0
    hostile_refused: int = 0
    overloaded: int = 0  # 503 with Retry-After from bounded admission: intended when admission is on
    unexpected: list[str] = field(default_factory=list)


async def _normal(client, url: str, request: BenchRequest, stream: bool, cancel: bool, counts: SoakCounts) -> None:
    body = {"prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.6, "stream": stream}
    try:
        if not stream:
            response = await client.post(url + "/v1/completions", json=body)
            if response.status_code == 200 and response.json()["choices"]:
                counts.completed += 1
            elif response.status_code == 503 and "retry-after" in response.headers:
                counts.overloaded += 1
            else:
                counts.unexpected.append(f"HTTP {response.status_code}: {response.text[:200]}")
            return
        chunks = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                if response.status_code == 503 and "retry-after" in response.headers:
                    counts.overloaded += 1
                else:
                    counts.unexpected.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    counts.streamed += 1
                    return
                if line.startswith("data: "):
                    if "error" in json.loads(line[6:]):
                        counts.unexpected.append(f"stream error event: {line[:200]}")
                        return
                    chunks += 1
                    if cancel and chunks >= 3:  # the client hangs up mid-stream
                        counts.cancelled += 1
                        return
        counts.unexpected.append("stream ended without [DONE]")
    except Exception as exc:
        counts.unexpected.append(f"{type(exc).__name__}: {exc}")


async def _hostile(client, url: str, index: int, counts: SoakCounts) -> None:
    body = HOSTILE_BODIES[index % len(HOSTILE_BODIES)]
    try:
        response = await client.post(
            url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
        error = response.json().get("error", {}) if "json" in response.headers.get("content-type", "") else {}
        if response.status_code == 400 and error.get("code") == 400:
            counts.hostile_refused += 1
        else:
            counts.unexpected.append(f"hostile {body!r}: HTTP {response.status_code}: {response.text[:200]}")
    except Exception as exc:
        counts.unexpected.append(f"hostile {body!r}: {type(exc).__name__}: {exc}")


def _metrics(url: str) -> dict[str, float]:
    import httpx

    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            values[key] = values.get(key, 0.0) + float(value)  # summed over DP ranks
    return values


def sample_processes(pid: int) -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of the process ``pid`` and all its descendants."""
    import psutil

    root = psutil.Process(pid)
    rss = fds = threads = count = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
                count += 1
        except psutil.NoSuchProcess:
            continue
    return {"rss_mib": rss / 2**20, "open_fds": fds, "threads": threads, "processes": count}


def _sample(pid: int, url: str, start: float) -> dict[str, float]:
    sample: dict[str, float] = {"t": time.monotonic() - start, **sample_processes(pid)}
    try:
        metrics = _metrics(url)
        sample["kv_cache_usage"] = metrics.get("engine_kv_cache_usage_perc", float("nan"))
        sample["running"] = metrics.get("engine_num_requests_running", float("nan"))
        sample["waiting"] = metrics.get("engine_num_requests_waiting", float("nan"))
    except Exception:  # a scrape that fails is a gap in the plot, not a crash of the bench
        pass
    return sample


async def drive(
    url: str,
    server_pid: int,
    requests: list[BenchRequest],
    duration_s: float,
    rate: float,
    sample_interval_s: float,
    seed: int = 0,
) -> tuple[SoakCounts, list[dict]]:
    """Send the mixed traffic for ``duration_s`` while sampling; the counts and the samples."""
    import httpx

    counts, samples = SoakCounts(), []
    rng = random.Random(seed)
    start = time.monotonic()

    async def sampler():
        while True:
            samples.append(await asyncio.to_thread(_sample, server_pid, url, start))
            await asyncio.sleep(sample_interval_s)

    sampling = asyncio.create_task(sampler())
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        index, arrival = 0, start
        while arrival - start < duration_s:
            if index % HOSTILE_EVERY == HOSTILE_AT:
                job = _hostile(client, url, index // HOSTILE_EVERY, counts)
            else:
                cancel = index % CANCEL_EVERY == CANCEL_AT
                job = _normal(client, url, requests[index % len(requests)], cancel or index % 2 == 0, cancel, counts)
            task = asyncio.create_task(job)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
            # arrivals keep to their own clock: time spent sending does not slow the rate
            arrival += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, arrival - time.monotonic()))
        if tasks:
            await asyncio.gather(*tasks)
    sampling.cancel()
    return counts, samples


def wait_drained(url: str, timeout_s: float = 120) -> Optional[dict[str, float]]:
    """Once nothing runs or waits: the metrics (KV usage must then be 0); None if it never drains."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = _metrics(url)
        if metrics.get("engine_num_requests_running") == 0 and metrics.get("engine_num_requests_waiting") == 0:
            return metrics
        time.sleep(0.5)
    return None


def verdict(samples: list[dict], warmup_s: float) -> dict:
    """RSS growth, descriptors and threads after warm-up: the first quarter of the steady samples against the
    last quarter (means for RSS, maxima for the counts, which requests in flight make jumpy)."""
    steady = [s for s in samples if s["t"] >= warmup_s]
    if len(steady) < 4:
        return {"steady_samples": len(steady), "judged": False}
    quarter = max(1, len(steady) // 4)
    first, last = steady[:quarter], steady[-quarter:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    peak = lambda rows, key: max(r[key] for r in rows)
    rss_growth = mean(last, "rss_mib") / mean(first, "rss_mib") - 1
    fds = (peak(first, "open_fds"), peak(last, "open_fds"))
    threads = (peak(first, "threads"), peak(last, "threads"))
    return {
        "steady_samples": len(steady),
        "judged": True,
        "rss_mib_first_quarter": round(mean(first, "rss_mib"), 1),
        "rss_mib_last_quarter": round(mean(last, "rss_mib"), 1),
        "rss_growth": round(rss_growth, 4),
        "rss_ok": rss_growth < RSS_GROWTH_LIMIT,
        "open_fds_first_last_peak": fds,
        "open_fds_ok": fds[1] <= fds[0] + FD_SLACK,
        "threads_first_last_peak": threads,
        "threads_ok": threads[1] <= threads[0] + THREAD_SLACK,
    }


def plot_soak(path: str, samples: list[dict], warmup_s: float, title: str) -> None:
    """Four panels over time: RSS, open descriptors, threads, KV-cache usage (warm-up shaded)."""
    from engine_bench.plot import plt

    panels = (
        ("rss_mib", "RSS (MiB, all processes)"),
        ("open_fds", "open file descriptors"),
        ("threads", "threads"),
        ("kv_cache_usage", "KV-cache usage (0-1)"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 9), sharex=True)
    times = [s["t"] / 60 for s in samples]
    for ax, (key, label) in zip(axes, panels):
        ax.plot(times, [s.get(key, float("nan")) for s in samples], linewidth=1)
        ax.axvspan(0, warmup_s / 60, color="grey", alpha=0.15)
        ax.set_ylabel(label, fontsize=8)
    axes[-1].set_xlabel("minutes (grey: warm-up)")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
