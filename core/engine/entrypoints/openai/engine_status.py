"""The live view's data (``GET /v1/engine/status``): the engine's counters sampled once a second for the last
minutes, turned into rates and a chart, with the plugins chosen and the product tables measured."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Optional

from engine.messages import SchedulerStats

logger = logging.getLogger("engine.server")

HISTORY_SECONDS = 300  # the chart's span: one sample a second
RATE_KEYS = ("prompt_tokens_per_s", "generation_tokens_per_s", "steps_per_s", "mean_step_ms", "mean_batch_size")


def _rank_view(stats: SchedulerStats) -> dict[str, Any]:
    return {
        "dp_rank": stats.dp_rank,
        "running": stats.num_running_reqs,
        "waiting": stats.num_waiting_reqs,
        "kv_cache_usage": round(stats.kv_cache_usage, 4),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4)
        if stats.prefix_cache_queries
        else 0.0,
        "requests_received": stats.num_requests_received,
    }


def interval(before: SchedulerStats, after: SchedulerStats, seconds: float) -> dict[str, float]:
    """What happened between two samples: token rates, steps' mean time and batch size."""
    a, b = before.steps, after.steps
    steps = b.num_steps - a.num_steps
    seconds = max(seconds, 1e-9)
    return {
        "prompt_tokens_per_s": round((b.num_prompt_tokens - a.num_prompt_tokens) / seconds, 1),
        "generation_tokens_per_s": round((b.num_generated_tokens - a.num_generated_tokens) / seconds, 1),
        "steps_per_s": round(steps / seconds, 2),
        "mean_step_ms": round(1000 * (b.step_seconds - a.step_seconds) / steps, 2) if steps else 0.0,
        "mean_batch_size": round((b.num_scheduled_requests - a.num_scheduled_requests) / steps, 2) if steps else 0.0,
    }


class StatusHistory:
    """The engine's counters, one sample a second for the last ``HISTORY_SECONDS`` (taken by ``run``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.samples: deque[tuple[float, SchedulerStats]] = deque(maxlen=HISTORY_SECONDS + 1)
        self.task: Optional[asyncio.Task] = None
        self.stopping = False

    def add(self, stats: SchedulerStats) -> None:
        self.samples.append((self.clock(), stats))

    def latest_rates(self) -> dict[str, float]:
        """The rates over the last few seconds (zeros before two samples)."""
        if len(self.samples) < 2:
            return dict.fromkeys(RATE_KEYS, 0.0)
        (t0, before), (t1, after) = self.samples[max(0, len(self.samples) - 4)], self.samples[-1]
        return interval(before, after, t1 - t0)

    def chart(self) -> list[dict[str, float]]:
        """One point per sample interval: its age in seconds (negative), the rates, running and waiting requests."""
        now = self.clock()
        points = []
        pairs = list(self.samples)
        for (t0, before), (t1, after) in zip(pairs, pairs[1:]):
            points.append(
                {
                    "t": round(t1 - now, 1),
                    **interval(before, after, t1 - t0),
                    "running": after.num_running_reqs,
                    "waiting": after.num_waiting_reqs,
                    "kv_cache_usage": round(after.kv_cache_usage, 4),
                }
            )
        return points

    async def run(self, engine, period: float = 1.0) -> None:
        """Sample ``engine.get_stats()`` every ``period`` seconds until cancelled (a failed sample is skipped)."""
        while not self.stopping:
            try:
                self.add(await asyncio.wait_for(engine.get_stats(), timeout=10))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a core restarting: the chart has a gap, the server goes on
                logger.debug("status sample skipped: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(period)

    def start(self, engine) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run(engine))

    async def stop(self) -> None:
        """End the sampler. Python 3.11's ``wait_for`` loses a cancellation that arrives as its sample completes
        (the task then samples on and the server's shutdown waited for it), so the loop also checks a flag and the
        cancellation is repeated until the task is done."""
        if self.task is None:
            return
        self.stopping = True
        while not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=0.1)
        self.task = None


def status_body(
    model_name: str,
    version: str,
    uptime_s: float,
    stats: SchedulerStats,
    history: StatusHistory,
    descriptions: list[dict[str, Any]],
    adapters: list[str],
    shadow: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The JSON of ``GET /v1/engine/status``."""
    spec = stats.spec_decoding
    return {
        "model": model_name,
        "version": version,
        "uptime_s": round(uptime_s, 1),
        "lora_adapters": adapters,
        "requests": {"running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs},
        "kv_cache": {
            "usage": round(stats.kv_cache_usage, 4),
            "free_blocks": stats.num_free_blocks,
            "total_blocks": stats.num_total_blocks,
            "prefix_cache_hit_rate": _rank_view(stats)["prefix_cache_hit_rate"],
        },
        "rates": history.latest_rates(),
        "totals": {
            "requests_received": stats.num_requests_received,
            "preemptions": stats.num_preemptions,
            "prompt_tokens": stats.steps.num_prompt_tokens,
            "generated_tokens": stats.steps.num_generated_tokens,
            "steps": stats.steps.num_steps,
        },
        "spec_decoding": None
        if spec is None
        else {
            "acceptance_rate": round(spec.acceptance_rate, 4),
            "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
        },
        "dp_ranks": [_rank_view(rank) for rank in stats.per_rank] or [_rank_view(stats)],
        "history": history.chart(),
        "plugins": descriptions[0]["plugins"] if descriptions else [],
        "product_tables": descriptions[0]["product_tables"] if descriptions else {},
        # with --shadow: its state and verdicts (GET /v1/shadow has the whole comparison)
        "shadow": None
        if shadow is None
        else {
            "overrides": shadow["overrides"],
            "state": shadow["state"],
            "verdict": shadow["verdict"],
            "speed_verdict": shadow["speed_verdict"],
            "requests": shadow["requests"],
        },
    }
