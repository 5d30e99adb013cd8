"""RestartPolicy: whether, and after how long, a dead engine core is started again."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


class RestartPolicy:
    """At most ``max_restarts`` restarts of each DP rank within ``window_s`` seconds, the k-th of them (counted
    in the window) after a backoff of 1, 2, 4 ... s (at most 30 s). ``max_restarts`` 0: never (fail-stop)."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.history: dict[int, deque[float]] = {}  # rank -> when each restart within the window was granted

    def restarts_in_window(self, rank: int) -> int:
        history = self.history.setdefault(rank, deque())
        now = self.clock()
        while history and now - history[0] > self.window_s:
            history.popleft()
        return len(history)

    def grant(self, rank: int) -> Optional[float]:
        """The backoff before restarting ``rank`` (the restart is counted now), or None: its budget is spent."""
        used = self.restarts_in_window(rank)
        if used >= self.max_restarts:
            return None
        self.history[rank].append(self.clock())
        return min(BACKOFF_FIRST_S * 2**used, BACKOFF_MAX_S)

    def describe_budget(self, rank: int) -> str:
        return f"{self.restarts_in_window(rank)} of {self.max_restarts} restarts within {self.window_s:g} s"
