"""DPRouter: which DP rank's engine core takes a request (the front end's half of data parallelism).

Load is vLLM's score, waiting x 4 + running, from the coordinator's latest state plus what this front end
sent since that state (so a burst of requests spreads before the next state arrives).

``least_loaded`` takes the rank with the lowest score. ``prefix_aware`` (like SGLang's cache-aware router)
takes, among the ranks that are not overloaded (score within ``data_parallel_balance_slack`` of the lowest),
the one holding the longest leading run of the prompt's prefix-cache blocks: what the rank's published
prefix summary holds, or what this front end sent it in the last few seconds (which the summary cannot show
yet). No rank holding at least half of the prompt's blocks: the least loaded (a short shared head, such as a
chat template's system prompt, is cheap to compute anywhere and must not pull every request to one rank).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional

from engine.config import VllmConfig
from engine.data_parallel.prefix_summary import PrefixSummary
from engine.kv_cache.hashing import extend_block_hashes
from engine.messages import DPState, EngineCoreRequest

WAITING_WEIGHT = 4
RECENT_TTL_S = 5.0  # a routed prefix counts for its rank this long; later the rank's own summary answers
RECENT_CAPACITY = 65536  # block hashes remembered
MIN_MATCH_FRACTION = 0.5  # of the prompt's full blocks, for the prefix to decide the rank


class DPRouter:
    """Chooses a rank per request and remembers it (for aborts) until the request finishes."""

    def __init__(self, vllm_config: VllmConfig, clock=time.monotonic):
        parallel = vllm_config.parallel
        self.num_ranks = parallel.data_parallel_size
        self.policy = parallel.data_parallel_routing
        self.slack = parallel.data_parallel_balance_slack
        self.block_size = vllm_config.cache.block_size
        self.prefix_caching = vllm_config.cache.enable_prefix_caching
        self.clock = clock
        self.waiting = [0] * self.num_ranks  # from the coordinator's latest state
        self.running = [0] * self.num_ranks
        self.sent_since_state = [0] * self.num_ranks
        self.summaries: list[Optional[PrefixSummary]] = [None] * self.num_ranks
        self.recent: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # block hash -> (rank, when routed)
        self.up = [True] * self.num_ranks  # a rank whose core died is left out until it is back
        self.num_routed = [0] * self.num_ranks
        self.num_routed_by_prefix = 0

    # ---- state from the coordinator ------------------------------------------------------------------------
    def update(self, state: DPState) -> None:
        for rank, load in enumerate(state.loads[: self.num_ranks]):
            if load is None or not self.up[rank]:  # a dead rank's last report is stale
                continue
            self.waiting[rank], self.running[rank] = load.num_waiting, load.num_running
            if load.prefix_bits is not None and load.prefix_num_bits:
                self.summaries[rank] = PrefixSummary(load.prefix_bits, load.prefix_num_bits)
        self.sent_since_state = [0] * self.num_ranks

    def scores(self) -> list[int]:
        return [
            WAITING_WEIGHT * (self.waiting[r] + self.sent_since_state[r]) + self.running[r]
            for r in range(self.num_ranks)
        ]

    # ---- routing --------------------------------------------------------------------------------------------
    def mark_down(self, rank: int) -> None:
        """``rank``'s core died: route nothing there, and forget what it held."""
        self.up[rank] = False
        self.summaries[rank] = None
        self.waiting[rank] = self.running[rank] = self.sent_since_state[rank] = 0
        for block_hash in [h for h, (r, _) in self.recent.items() if r == rank]:
            del self.recent[block_hash]

    def mark_up(self, rank: int) -> None:
        self.up[rank] = True

    def route(self, request: EngineCoreRequest) -> int:
        """The rank for ``request`` among the ranks up (ValueError when none is). Which rank serves which request
        is the client's to remember (``MPClient.in_flight``)."""
        live = [r for r in range(self.num_ranks) if self.up[r]]
        if not live:
            raise ValueError("no DP rank is up")
        scores = self.scores()
        least_loaded = min(live, key=lambda r: (scores[r], self.num_routed[r]))
        rank = least_loaded
        if self.policy == "prefix_aware" and self.prefix_caching:
            block_hashes: list[bytes] = []
            extend_block_hashes(
                block_hashes,
                request.prompt_token_ids,
                self.block_size,
                request.cache_salt,
                request.lora_request.prefix_key if request.lora_request is not None else None,
            )
            rank = self._prefix_rank(block_hashes, scores, least_loaded)
            self._remember(block_hashes, rank)
        self.sent_since_state[rank] += 1
        self.num_routed[rank] += 1
        return rank

    def _prefix_rank(self, block_hashes: list[bytes], scores: list[int], least_loaded: int) -> int:
        if not block_hashes:
            return least_loaded
        bar = scores[least_loaded] + self.slack
        matches = {
            r: self.match_length(r, block_hashes) for r in range(self.num_ranks) if self.up[r] and scores[r] <= bar
        }
        best = max(matches, key=lambda r: (matches[r], -scores[r]))
        if matches[best] == 0 or matches[best] < MIN_MATCH_FRACTION * len(block_hashes):
            return least_loaded
        self.num_routed_by_prefix += 1
        return best

    def match_length(self, rank: int, block_hashes: list[bytes]) -> int:
        """Leading blocks of the prompt that ``rank`` holds, by its summary or by what was routed there lately."""
        summary = self.summaries[rank]
        held = summary.match_length(block_hashes) if summary is not None else 0
        now = self.clock()
        routed = 0
        for block_hash in block_hashes:
            entry = self.recent.get(block_hash)
            if entry is None or entry[0] != rank or now - entry[1] > RECENT_TTL_S:
                break
            routed += 1
        return max(held, routed)

    def _remember(self, block_hashes: list[bytes], rank: int) -> None:
        now = self.clock()
        for block_hash in block_hashes:
            self.recent[block_hash] = (rank, now)
            self.recent.move_to_end(block_hash)
        while len(self.recent) > RECENT_CAPACITY:
            self.recent.popitem(last=False)
