"""Prometheus metrics of the server (prometheus-client), vLLM's set under an ``engine_`` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.messages import SpecDecodingStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """One registry per app, so several servers in one process do not collide.

    Engine-core series carry a ``dp_rank`` label, one series per DP rank (``sum without (dp_rank)`` totals
    them); request counters and latencies are this API server's own (``api_server`` in engine_api_server_info).
    """

    def __init__(self, model_name: str, api_server: int = 0):
        self.registry = CollectorRegistry()
        Gauge(
            "engine_api_server_info",
            "Which API-server process answered (--api-server-count)",
            ["model_name", "api_server"],
            registry=self.registry,
        ).labels(model_name, str(api_server)).set(1)
        labels = ["model_name"]
        rank_labels = ["model_name", "dp_rank"]  # engine-core gauges and counters: one series per DP rank
        gauge = lambda name, doc: Gauge(name, doc, rank_labels, registry=self.registry)
        counter = lambda name, doc: Counter(name, doc, labels, registry=self.registry).labels(model_name)
        rank_counter = lambda name, doc, extra=(): Counter(name, doc, rank_labels + list(extra), registry=self.registry)
        histogram = lambda name, doc: Histogram(
            name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry
        ).labels(model_name)
        self.num_requests_running = gauge("engine_num_requests_running", "Requests in the running queue")
        self.num_requests_waiting = gauge("engine_num_requests_waiting", "Requests in the waiting queue")
        self.kv_cache_usage = gauge("engine_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)")
        self.prefix_cache_queries = gauge("engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = gauge("engine_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_cache_hit_rate = gauge("engine_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens)")
        self.num_preemptions = gauge("engine_num_preemptions", "Preemptions since start")
        self.num_requests_received = gauge("engine_num_requests_received", "Requests an engine core was given")
        self.prompt_tokens = counter("engine_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("engine_generation_tokens", "Tokens generated")
        self.requests_finished = counter("engine_request_success", "Requests finished")
        self.requests_refused = Counter(
            "engine_request_refused",
            "Calls refused with 503 because the server was overloaded (reason: the cap that was reached)",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.time_to_first_token = histogram("engine_time_to_first_token_seconds", "Time to first token")
        self.inter_token_latency = histogram("engine_inter_token_latency_seconds", "Time between tokens")
        self.e2e_latency = histogram("engine_e2e_request_latency_seconds", "End-to-end request latency")
        # speculative decoding (vLLM's names, engine_ prefix); counters advance by the engine cores' totals
        self.spec_num_drafts = rank_counter("engine_spec_decode_num_drafts", "Request-steps that verified drafts")
        self.spec_num_draft_tokens = rank_counter("engine_spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_num_accepted_tokens = rank_counter("engine_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._spec_per_pos = rank_counter(
            "engine_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            ["position"],
        )
        # MoE models: what people look at first when one is slow (a hot expert, a rank with the popular experts)
        self.moe_expert_tokens = rank_counter(
            "engine_moe_expert_tokens", "Tokens routed to each expert of each MoE layer", ["layer", "expert"]
        )
        # faults: what this API server's view of the engine cores is (DP ranks up, deaths, restarts, migrations)
        fault_gauge = lambda name, doc: Gauge(name, doc, labels, registry=self.registry).labels(model_name)
        self.dp_ranks_alive = fault_gauge("engine_dp_ranks_alive", "DP ranks whose engine core is up and routable")
        self.core_deaths = fault_gauge("engine_core_deaths", "Engine cores that died or were killed as wedged")
        self.core_restarts = fault_gauge("engine_core_restarts", "Engine cores restarted (by this process)")
        self.requests_migrated = fault_gauge(
            "engine_requests_migrated", "Requests moved to another DP rank when theirs died"
        )
        self._model_name = model_name
        self._spec_seen: dict[str, SpecDecodingStats] = {}  # per DP rank: the totals already counted
        self._expert_seen: dict[str, dict[int, list[int]]] = {}  # per DP rank: the expert counts already counted

    def update_from_stats(self, stats) -> None:
        """Set every engine-core series from ``get_stats()``: one per DP rank (``dp_rank`` label)."""
        for rank_stats in stats.per_rank or [stats]:
            self._update_rank(str(rank_stats.dp_rank or 0), rank_stats)

    def update_from_health(self, report: dict) -> None:
        """The fault gauges from ``AsyncLLM.health()``."""
        self.dp_ranks_alive.set(report["dp_ranks_alive"])
        self.core_deaths.set(report["engine_core_deaths"])
        self.core_restarts.set(report["engine_core_restarts"] or 0)
        self.requests_migrated.set(report["requests_migrated"])

    def _update_rank(self, rank: str, stats) -> None:
        labels = (self._model_name, rank)
        self.num_requests_running.labels(*labels).set(stats.num_running_reqs)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting_reqs)
        self.kv_cache_usage.labels(*labels).set(stats.kv_cache_usage)
        self.prefix_cache_queries.labels(*labels).set(stats.prefix_cache_queries)
        self.prefix_cache_hits.labels(*labels).set(stats.prefix_cache_hits)
        self.prefix_cache_hit_rate.labels(*labels).set(
            stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        )
        self.num_preemptions.labels(*labels).set(stats.num_preemptions)
        self.num_requests_received.labels(*labels).set(stats.num_requests_received)
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            self._count_spec(rank, spec)
        if stats.expert_load:
            self._count_expert_load(rank, stats.expert_load)

    def _count_expert_load(self, rank: str, load: dict[int, list[int]]) -> None:
        seen = self._expert_seen.get(rank, {})
        for layer, counts in load.items():
            before = seen.get(layer, [])
            for expert, total in enumerate(counts):
                advance = total - (before[expert] if expert < len(before) else 0)
                if advance > 0:
                    self.moe_expert_tokens.labels(self._model_name, rank, str(layer), str(expert)).inc(advance)
        self._expert_seen[rank] = {layer: list(counts) for layer, counts in load.items()}

    def _count_spec(self, rank: str, spec: SpecDecodingStats) -> None:
        seen = self._spec_seen.get(rank)
        labels = (self._model_name, rank)
        advance = lambda counter, now, before: counter.labels(*labels).inc(max(0, now - before))
        advance(self.spec_num_drafts, spec.num_drafts, seen.num_drafts if seen else 0)
        advance(self.spec_num_draft_tokens, spec.num_draft_tokens, seen.num_draft_tokens if seen else 0)
        advance(self.spec_num_accepted_tokens, spec.num_accepted_tokens, seen.num_accepted_tokens if seen else 0)
        before = seen.num_accepted_tokens_per_pos if seen else []
        for position, total in enumerate(spec.num_accepted_tokens_per_pos):
            counter = self._spec_per_pos.labels(*labels, str(position))
            counter.inc(max(0, total - (before[position] if position < len(before) else 0)))
        self._spec_seen[rank] = spec


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
