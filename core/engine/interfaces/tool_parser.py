"""Tool-call parser interface: turns what a model writes when it may call a tool into OpenAI ``tool_calls``.

Used for ``tool_choice: "auto"`` (the model decides whether to call a tool, in its own format). A parser is
constructed per chat request in the API server as ``cls(tokenizer)``, so it may keep the state of one stream.
"""

from __future__ import annotations

import uuid
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.interfaces.base import Pluggable


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def to_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ExtractedToolCalls:
    """A finished answer split into its text and its tool calls."""

    content: Optional[str]
    tool_calls: list[ToolCall]


@dataclass
class DeltaMessage:
    """What one streamed text delta adds: text, and tool calls (OpenAI delta dicts with an ``index``)."""

    content: Optional[str] = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolParser(Pluggable):
    """Finds tool calls in a model's text; chosen by ``server.tool_call_parser``."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Split a finished answer into content and tool calls (text that does not parse stays content)."""

    @abstractmethod
    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool
    ) -> Optional[DeltaMessage]:
        """The delta to send for ``delta_text`` (None: nothing yet, the text is held back); ``finished``: the
        last delta of the answer, everything held back must come out."""
