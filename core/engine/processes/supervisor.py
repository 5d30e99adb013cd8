"""EngineCoreSupervisor: restarts the engine cores that died, as the RestartPolicy allows."""

from __future__ import annotations

import logging
import time
from typing import Optional

from engine.config import VllmConfig
from engine.processes.restart_policy import RestartPolicy

logger = logging.getLogger(__name__)


class EngineCoreSupervisor:
    """Owned by whoever started the engine cores (the front end, or ``engine serve``'s launcher with several API
    servers). ``core_died`` asks the policy for a restart; ``start_due_restarts`` starts the cores whose backoff
    ended. A rank whose budget is spent is ``given_up``: it stays down."""

    def __init__(self, manager, vllm_config: VllmConfig):
        parallel = vllm_config.parallel
        self.manager = manager  # CoreEngineProcManager: restart(rank) -> pid
        self.policy = RestartPolicy(parallel.max_restarts, parallel.restart_window_s)
        self.due: dict[int, float] = {}  # rank -> when its restart starts
        self.given_up: dict[int, str] = {}  # rank -> why it stays down
        self.num_restarts = 0

    def core_died(self, rank: int, reason: str) -> Optional[float]:
        """Schedule ``rank``'s restart: the backoff in seconds, or None when its restart budget is spent."""
        backoff = self.policy.grant(rank)
        if backoff is None:
            budget = self.policy.describe_budget(rank)
            self.given_up[rank] = f"{reason}; not restarted ({budget} already)"
            logger.error("%s: not restarted (%s already)", reason, budget)
            return None
        self.due[rank] = time.monotonic() + backoff
        logger.error("%s: restarting it in %.0f s (%s)", reason, backoff, self.policy.describe_budget(rank))
        return backoff

    def restart_pending(self, rank: int) -> bool:
        return rank in self.due

    def start_due_restarts(self) -> list[int]:
        """Start every core whose backoff ended; the ranks started (each announces itself with READY once loaded)."""
        now = time.monotonic()
        started = []
        for rank, when in list(self.due.items()):
            if when <= now:
                del self.due[rank]
                pid = self.manager.restart(rank)
                self.num_restarts += 1
                logger.info("engine core of DP rank %d restarted (pid %d), loading", rank, pid)
                started.append(rank)
        return started
