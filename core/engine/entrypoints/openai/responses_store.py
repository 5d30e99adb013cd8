"""The Responses API's store: responses made with ``store: true``, kept in this API server's memory so that
``GET /v1/responses/{id}`` finds them and ``previous_response_id`` continues their conversation.

Bounded twice: at most ``server.responses_store_max_entries`` responses (the oldest goes first) and each for
``server.responses_store_ttl`` seconds. Nothing is written to disk; a restart forgets every response.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class StoredResponse:
    """A response object and the conversation it ended (the turns the model saw, its own output last)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    expires_at: float


class ResponseStore:
    """Responses by id, oldest first; at most ``max_entries``, each for ``ttl`` seconds."""

    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._expire()
            self._entries[response["id"]] = StoredResponse(response, conversation, self.clock() + self.ttl)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            self._expire()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now:
                break
            self._entries.popitem(last=False)
