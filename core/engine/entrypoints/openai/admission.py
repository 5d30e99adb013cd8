"""Bounded admission: an overloaded server refuses new work at once (503 with ``Retry-After``) instead of queueing
it until every client times out.

A request *waits* from its admission until its first output (the time its client sees as TTFT). With
``server.max_waiting_requests`` (and/or ``server.max_waiting_tokens``, prompt tokens) set, a call whose prompts would
take this API server's waiting requests (tokens) past the cap is refused whole, before anything of it starts; a
call is always admitted when nothing waits, so one prompt larger than the token cap is still served. With several
API servers (``server.api_server_count``) each one holds its share of the caps. ``Retry-After`` is the median
time the last admitted requests waited for their first output, in whole seconds (at least 1).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from engine.entrypoints.openai.errors import APIError

STALE_RESERVATION_S = 60.0  # a reservation whose request never started (its client left first) is dropped then


@dataclass
class _Waiting:
    tokens: int
    since: float
    started: bool = False  # its generator runs (then its end releases it, whatever happens)


class OverloadedError(APIError):
    """503 with ``Retry-After``: the server's waiting requests or tokens are at their cap."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, 503, err_type="ServiceUnavailableError")
        self.headers = {"Retry-After": str(retry_after_s)}


class AdmissionControl:
    """The requests of one API server that wait for their first output, against the configured caps."""

    def __init__(
        self,
        max_waiting_requests: Optional[int],
        max_waiting_tokens: Optional[int],
        on_refused: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.on_refused = on_refused  # the metric of refusals, by reason
        self.clock = clock
        self.waiting: dict[str, _Waiting] = {}
        self.recent_waits: deque[float] = deque(maxlen=32)  # seconds from admission to the first output

    @property
    def enabled(self) -> bool:
        return self.max_waiting_requests is not None or self.max_waiting_tokens is not None

    @property
    def waiting_tokens(self) -> int:
        return sum(w.tokens for w in self.waiting.values())

    def admit(self, requests: list[tuple[str, int]]) -> None:
        """Reserve ``(request id, prompt tokens)`` of one call, or raise ``OverloadedError`` for all of them."""
        if not self.enabled:
            return
        now = self.clock()
        for request_id in [r for r, w in self.waiting.items() if not w.started and now - w.since > STALE_RESERVATION_S]:
            del self.waiting[request_id]
        if self.waiting:
            reason = None
            if self.max_waiting_requests is not None and len(self.waiting) + len(requests) > self.max_waiting_requests:
                reason = (
                    "waiting_requests",
                    f"{len(self.waiting)} requests wait for their first token (max_waiting_requests "
                    f"{self.max_waiting_requests})",
                )
            tokens = sum(t for _, t in requests)
            if reason is None and self.max_waiting_tokens is not None:
                if self.waiting_tokens + tokens > self.max_waiting_tokens:
                    reason = (
                        "waiting_tokens",
                        f"{self.waiting_tokens} prompt tokens wait and this call brings {tokens} "
                        f"(max_waiting_tokens {self.max_waiting_tokens})",
                    )
            if reason is not None:
                self.on_refused(reason[0])
                retry = self.retry_after_s()
                raise OverloadedError(f"the server is overloaded: {reason[1]}; retry after {retry} s", retry)
        for request_id, tokens in requests:
            self.waiting[request_id] = _Waiting(tokens, now)

    def started(self, request_id: str) -> None:
        """The request's generator runs: from now on its end releases it."""
        waiting = self.waiting.get(request_id)
        if waiting is not None:
            waiting.started = True

    def first_output(self, request_id: str) -> None:
        """The request's first output came: it no longer waits."""
        waiting = self.waiting.pop(request_id, None)
        if waiting is not None:
            self.recent_waits.append(self.clock() - waiting.since)

    def release(self, request_id: str) -> None:
        """The request ended (or failed, or was cancelled) before or after its first output."""
        self.waiting.pop(request_id, None)

    def retry_after_s(self) -> int:
        if not self.recent_waits:
            return 1
        return max(1, math.ceil(statistics.median(self.recent_waits)))
