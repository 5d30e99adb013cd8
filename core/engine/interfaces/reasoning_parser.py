"""Reasoning-parser interface: splits what a reasoning model writes into its reasoning and its answer.

Chosen by ``server.reasoning_parser`` (vLLM's ``--reasoning-parser``). Constructed in the API server per chat or
Responses request as ``cls(tokenizer)``, so it may keep the state of one stream. Tool-call parsing and the
answer's ``content`` see only the answer part.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from engine.interfaces.base import Pluggable


@dataclass
class ReasoningDelta:
    """What one streamed text delta adds to the reasoning and to the answer (None: nothing)."""

    reasoning_content: Optional[str] = None
    content: Optional[str] = None


class ReasoningParser(Pluggable):
    """Finds the reasoning part of a model's output; chosen by ``server.reasoning_parser``."""

    # the text that opens and closes the reasoning (a thinking budget forces ``end_text`` when it is spent)
    start_text: ClassVar[str] = ""
    end_text: ClassVar[str] = ""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, answer) of a finished output; either may be None."""

    @abstractmethod
    def extract_reasoning_streaming(self, current_text: str, finished: bool) -> ReasoningDelta:
        """What the output so far, ``current_text``, adds since the last call (text that may still turn into a
        tag is held back until ``finished``)."""

    @classmethod
    def reasoning_starts_at_output(cls) -> bool:
        """Whether the output is reasoning from its first token (the chat template opened it), so a thinking
        budget counts from there; otherwise it counts from ``start_text``."""
        return False
