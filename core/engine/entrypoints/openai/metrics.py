"""Prometheus metrics of the server (prometheus-client), vLLM's set under an ``engine_`` prefix.

Two kinds of series. The engine cores' (queues, KV cache, prefix cache, preemptions, speculative decoding,
expert load, faults) come from the latest ``get_stats()`` and health report, which every API server asks the
cores for when it is scraped: a collector builds them at scrape time, so any API server shows the whole engine.
The front end's (requests, tokens, latencies, refusals) are counted where each request is served: with several
API servers (``--api-server-count``) they live in prometheus-client's multiprocess mode, in files of a folder the
launcher makes (``PROMETHEUS_MULTIPROC_DIR``), and each scrape adds up every API server's.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.messages import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# engine-core gauges: (name, help, value of one rank's SchedulerStats)
_RANK_GAUGES = (
    ("engine_num_requests_running", "Requests in the running queue", lambda s: s.num_running_reqs),
    ("engine_num_requests_waiting", "Requests in the waiting queue", lambda s: s.num_waiting_reqs),
    ("engine_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", lambda s: s.kv_cache_usage),
    ("engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", lambda s: s.prefix_cache_queries),
    ("engine_prefix_cache_hits", "Prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hits),
    (
        "engine_prefix_cache_hit_rate",
        "Prefix-cache hits / queries (tokens)",
        lambda s: s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
    ),
    ("engine_num_preemptions", "Preemptions since start", lambda s: s.num_preemptions),
    ("engine_num_requests_received", "Requests an engine core was given", lambda s: s.num_requests_received),
)
# faults, from AsyncLLM.health(): (name, help, key)
_HEALTH_GAUGES = (
    ("engine_dp_ranks_alive", "DP ranks whose engine core is up and routable", "dp_ranks_alive"),
    ("engine_core_deaths", "Engine cores that died or were killed as wedged", "engine_core_deaths"),
    ("engine_core_restarts", "Engine cores restarted (by this process)", "engine_core_restarts"),
    ("engine_requests_migrated", "Requests moved to another DP rank when theirs died", "requests_migrated"),
)


def multiprocess_mode() -> bool:
    """Whether this process counts its front-end series in the shared multiprocess folder."""
    return bool(os.environ.get(MULTIPROC_DIR_ENV))


class EngineCollector(Collector):
    """The engine cores' series, built at scrape time from the latest stats and health report. Series carry a
    ``dp_rank`` label, one per DP rank (``sum without (dp_rank)`` totals them); counters are the cores' totals
    since they started (a restarted core starts again from 0: a counter reset to Prometheus)."""

    def __init__(self, model_name: str, api_server: int):
        self.model_name = model_name
        self.api_server = api_server
        self.stats: Optional[SchedulerStats] = None
        self.health: Optional[dict] = None

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "engine_api_server_info",
            "Which API-server process answered (--api-server-count)",
            labels=["model_name", "api_server"],
        )
        info.add_metric([self.model_name, str(self.api_server)], 1)
        yield info
        if self.health is not None:
            for name, doc, key in _HEALTH_GAUGES:
                gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
                gauge.add_metric([self.model_name], self.health.get(key) or 0)
                yield gauge
        if self.stats is None:
            return
        ranks = [(str(s.dp_rank or 0), s) for s in (self.stats.per_rank or [self.stats])]
        labels = ["model_name", "dp_rank"]
        for name, doc, value in _RANK_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for rank, stats in ranks:
                gauge.add_metric([self.model_name, rank], value(stats))
            yield gauge
        yield from self._spec(ranks, labels)
        experts = CounterMetricFamily(
            "engine_moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer",
            labels=[*labels, "layer", "expert"],
        )
        for rank, stats in ranks:
            for layer, counts in stats.expert_load.items():
                for expert, total in enumerate(counts):
                    experts.add_metric([self.model_name, rank, str(layer), str(expert)], total)
        yield experts

    def _spec(self, ranks: list[tuple[str, SchedulerStats]], labels: list[str]) -> Iterable[Metric]:
        """Speculative decoding (vLLM's names, engine_ prefix), for the ranks that run it."""
        spec_ranks = [(rank, s.spec_decoding) for rank, s in ranks if s.spec_decoding is not None]
        if not spec_ranks:
            return
        for name, doc, field in (
            ("engine_spec_decode_num_drafts", "Request-steps that verified drafts", "num_drafts"),
            ("engine_spec_decode_num_draft_tokens", "Draft tokens verified", "num_draft_tokens"),
            ("engine_spec_decode_num_accepted_tokens", "Draft tokens accepted", "num_accepted_tokens"),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            for rank, spec in spec_ranks:
                counter.add_metric([self.model_name, rank], getattr(spec, field))
            yield counter
        per_pos = CounterMetricFamily(
            "engine_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            labels=[*labels, "position"],
        )
        for rank, spec in spec_ranks:
            for position, total in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([self.model_name, rank, str(position)], total)
        yield per_pos


class ShadowCollector(Collector):
    """The shadow A/B's series (``engine_shadow_*``), from the mirror's report at scrape time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.report: Optional[dict] = None

    def collect(self) -> Iterable[Metric]:
        report = self.report
        if report is None:
            return
        labels, values = (
            ["model_name", "overrides"],
            [self.model_name, ",".join(f"{k}={v}" for k, v in report["overrides"].items())],
        )
        requests = report["requests"]
        for name, doc, key in (
            ("engine_shadow_requests_seen", "Requests the server served while a shadow was configured", "seen"),
            ("engine_shadow_mirrored", "Finished requests queued for the shadow", "mirrored"),
            (
                "engine_shadow_dropped",
                "Mirrored requests dropped: the shadow's queue was full (or it stopped)",
                "dropped",
            ),
            ("engine_shadow_completed", "Mirrored requests the shadow ran and compared", "completed"),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, requests[key])
            yield counter
        up = GaugeMetricFamily("engine_shadow_up", "1 while the shadow engine runs", labels=labels)
        up.add_metric(values, 1 if report["state"] == "running" else 0)
        yield up
        comparison = report["comparison"]
        if comparison is None:
            return
        errors = CounterMetricFamily("engine_shadow_errors", "Mirrored requests the shadow failed on", labels=labels)
        errors.add_metric(values, comparison["errors"]["count"])
        yield errors
        tokens = CounterMetricFamily(
            "engine_shadow_tokens_compared", "Output tokens compared teacher-forced", labels=labels
        )
        tokens.add_metric(values, comparison["tokens_compared"])
        yield tokens
        agreement = comparison["top1_agreement"]
        for name, doc, value in (
            ("engine_shadow_agreement", "Top-1 agreement of the shadow with the primary (0-1)", agreement["rate"]),
            (
                "engine_shadow_counted_disagreements",
                "Top-1 disagreements where the primary's margin exceeds the dtype's tolerance",
                agreement["counted_disagreements"],
            ),
            (
                "engine_shadow_latency_ratio",
                "Shadow TPOT / primary TPOT (geometric mean)",
                comparison["tpot_ratio"]["geometric_mean"],
            ),
        ):
            if value is not None:
                gauge = GaugeMetricFamily(name, doc, labels=labels)
                gauge.add_metric(values, value)
                yield gauge
        delta = comparison["logprob_delta"]["histogram"]
        cumulative, buckets = 0, []
        for bound, count in zip(delta["le"], delta["counts"]):
            cumulative += count
            buckets.append((str(bound) if isinstance(bound, str) else repr(bound), cumulative))
        histogram = HistogramMetricFamily(
            "engine_shadow_logprob_delta",
            "|shadow - primary| log-probability of the primary's token, nats",
            labels=labels,
        )
        mean_abs = comparison["logprob_delta"]["mean_abs"] or 0.0
        histogram.add_metric(values, buckets, sum_value=mean_abs * comparison["tokens_compared"])
        yield histogram


class ServerMetrics:
    """One registry per app, so several servers in one process do not collide (``registry``: what a scrape
    shows of this process alone). ``exposition()`` is what ``/metrics`` answers."""

    def __init__(self, model_name: str, api_server: int = 0):
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name, api_server)
        self.registry.register(self.engine)
        self.shadow = ShadowCollector(model_name)
        self.registry.register(self.shadow)
        self.shared = multiprocess_mode()
        # front-end series: in the shared folder with several API servers (not in a registry: the folder's
        # collector shows every process's at once), else in this registry
        own = None if self.shared else self.registry
        labels = ["model_name"]
        counter = lambda name, doc: Counter(name, doc, labels, registry=own).labels(model_name)
        histogram = lambda name, doc: Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=own).labels(
            model_name
        )
        self.prompt_tokens = counter("engine_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("engine_generation_tokens", "Tokens generated")
        self.requests_finished = counter("engine_request_success", "Requests finished")
        self.requests_refused = Counter(
            "engine_request_refused",
            "Calls refused with 503 because the server was overloaded (reason: the cap that was reached)",
            ["model_name", "reason"],
            registry=own,
        )
        adapter_counter = lambda name, doc: Counter(name, doc, ["model_name", "lora_name"], registry=own)
        self._adapter_requests = adapter_counter("engine_lora_request_success", "Requests finished, per LoRA adapter")
        self._adapter_prompt_tokens = adapter_counter("engine_lora_prompt_tokens", "Prompt tokens, per LoRA adapter")
        self._adapter_generation_tokens = adapter_counter(
            "engine_lora_generation_tokens", "Tokens generated, per LoRA adapter"
        )
        self.model_name = model_name
        self.time_to_first_token = histogram("engine_time_to_first_token_seconds", "Time to first token")
        self.inter_token_latency = histogram("engine_inter_token_latency_seconds", "Time between tokens")
        self.e2e_latency = histogram("engine_e2e_request_latency_seconds", "End-to-end request latency")

    def adapter_finished(self, lora_name: str, prompt_tokens: int, generation_tokens: int) -> None:
        """Count a finished request of a LoRA adapter (the base model's are the unlabelled series)."""
        self._adapter_requests.labels(self.model_name, lora_name).inc()
        self._adapter_prompt_tokens.labels(self.model_name, lora_name).inc(prompt_tokens)
        self._adapter_generation_tokens.labels(self.model_name, lora_name).inc(generation_tokens)

    def update_from_stats(self, stats: SchedulerStats) -> None:
        """The engine-core series from ``get_stats()`` (every DP rank's in ``per_rank``)."""
        self.engine.stats = stats

    def update_from_shadow(self, report: dict) -> None:
        """The shadow A/B's series from ``ShadowMirror.report()``."""
        self.shadow.report = report

    def update_from_health(self, report: dict) -> None:
        """The fault gauges from ``AsyncLLM.health()``."""
        self.engine.health = report

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers: the engine's series, and the front end's of every API server."""
        text = generate_latest(self.registry)
        if self.shared:
            from prometheus_client import multiprocess

            every_server = CollectorRegistry()
            multiprocess.MultiProcessCollector(every_server)
            text += generate_latest(every_server)
        return text


class RequestTimer:
    """Measures TTFT, inter-token latency and end-to-end latency of one request."""

    def __init__(self, metrics: ServerMetrics, clock):
        self.metrics, self.clock = metrics, clock
        self.start = self.last = clock()
        self.tokens = 0

    def on_output(self, num_tokens: int) -> None:
        if num_tokens <= self.tokens:
            return
        now = self.clock()
        if self.tokens == 0:
            self.metrics.time_to_first_token.observe(now - self.start)
        else:
            self.metrics.inter_token_latency.observe((now - self.last) / (num_tokens - self.tokens))
        self.tokens, self.last = num_tokens, now

    def on_finish(self, prompt_tokens: int) -> None:
        self.metrics.e2e_latency.observe(self.clock() - self.start)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(self.tokens)
        self.metrics.requests_finished.inc()
