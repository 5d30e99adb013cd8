"""A response's output items (reasoning, message, function calls), built from a generation's pieces, and the typed
stream events that announce them (``response.output_item.added``, ``response.output_text.delta``...)."""

from __future__ import annotations

import copy
import uuid
from typing import Any, Optional


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Output items written piece by piece; each piece also becomes the stream events a client accumulates.
    One item is open at a time: a piece of another kind closes it (its ``...done`` events) and opens a new one."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.sequence_number = 0
        self.open: Optional[dict[str, Any]] = None
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's stream index -> its item

    # ---- events ---------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event of type ``kind`` with the next sequence number (kept for ``take_events``)."""
        event = {"type": kind, "sequence_number": self.sequence_number, **copy.deepcopy(fields)}
        self.sequence_number += 1
        self.events.append(event)
        return event

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    # ---- pieces ---------------------------------------------------------------------------------
    def reasoning(self, text: str) -> None:
        if text:
            item = self._open_text_item("reasoning", "reasoning_text")
            item["content"][0]["text"] += text
            self.event("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def text(self, text: str) -> None:
        if text:
            item = self._open_text_item("message", "output_text")
            item["content"][0]["text"] += text
            self.event("response.output_text.delta", **self._where(item), content_index=0, delta=text, logprobs=[])

    def call_start(self, index: int, call_id: str, name: str, arguments: str) -> None:
        """A tool call begins (``index``: its place among the answer's calls), with its first arguments."""
        self.close_item()
        item = {
            "id": item_id("fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        self.open, self.calls[index] = item, item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        self.call_arguments(index, arguments)

    def call_arguments(self, index: int, delta: str) -> None:
        item = self.calls[index]
        if delta:
            item["arguments"] += delta
            self.event("response.function_call_arguments.delta", **self._where(item), delta=delta)

    def close_item(self, status: str = "completed") -> None:
        """End the open item with its ``...done`` events."""
        item, self.open = self.open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "function_call":
            self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            self.event(kind, **where, content_index=0, text=part["text"], **extra)
            self.event("response.content_part.done", **where, content_index=0, part=part)
        item["status"] = status
        self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def _open_text_item(self, kind: str, part_type: str) -> dict[str, Any]:
        if self.open is not None and self.open["type"] == kind:
            return self.open
        self.close_item()
        part: dict[str, Any] = {"type": part_type, "text": ""}
        item: dict[str, Any]
        if kind == "message":
            part["annotations"] = []
            item = {
                "id": item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        self.items.append(item)
        self.open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        item["content"].append(part)
        self.event("response.content_part.added", **self._where(item), content_index=0, part=part)
        return item
