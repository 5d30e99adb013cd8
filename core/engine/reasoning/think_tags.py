"""Reasoning written between ``<think>`` and ``</think>`` (DeepSeek-R1, Qwen3, QwQ and many distills).

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output is reasoning from its first
  token until ``</think>`` (an output that repeats the opening tag is read the same way); no closing tag: all of it
  is reasoning (it was cut by max_tokens).
- ``qwen3``: the output is reasoning only when it opens with ``<think>`` (with ``enable_thinking: false`` the
  template closes an empty block in the prompt and the output is all answer).
"""

from __future__ import annotations

from typing import Optional

from engine.hookspecs import hookimpl
from engine.interfaces.reasoning_parser import ReasoningDelta, ReasoningParser

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ThinkTagReasoningParser(ReasoningParser):
    """``<think>reasoning</think>answer``; ``opens_in_reasoning`` says whether the output starts inside the block."""

    start_text, end_text = START, END
    opens_in_reasoning = True

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.sent = 0  # characters of the output already sent (as reasoning, answer or tags)
        self.state: Optional[str] = None  # None: undecided (qwen3's start); "reasoning"; "answer"

    @classmethod
    def reasoning_starts_at_output(cls) -> bool:
        return cls.opens_in_reasoning

    def extract_reasoning(self, text: str) -> tuple[Optional[str], Optional[str]]:
        body = text
        if text.lstrip().startswith(START):
            body = text.lstrip()[len(START) :]
        elif not self.opens_in_reasoning:
            return None, text or None
        reasoning, closed, answer = body.partition(END)
        if not closed:
            return reasoning or None, None
        return reasoning or None, answer.lstrip("\n") or None

    def extract_reasoning_streaming(self, current_text: str, finished: bool) -> ReasoningDelta:
        delta = ReasoningDelta()
        if self.state is None:
            head = current_text.lstrip()
            if head.startswith(START):
                self.sent = len(current_text) - len(head) + len(START)
                self.state = "reasoning"
            elif START.startswith(head) and not finished:
                return delta  # may still open the block
            else:
                self.state = "reasoning" if self.opens_in_reasoning else "answer"
        if self.state == "reasoning":
            rest = current_text[self.sent :]
            end = rest.find(END)
            if end < 0:
                hold = 0 if finished else _partial_suffix(rest, END)
                delta.reasoning_content = rest[: len(rest) - hold] or None
                self.sent += len(rest) - hold
                return delta
            delta.reasoning_content = rest[:end] or None
            self.sent += end + len(END)
            self.state = "answer_start"
        if self.state == "answer_start":  # the newline after </think> is not part of the answer
            rest = current_text[self.sent :]
            stripped = rest.lstrip("\n")
            if not stripped and not finished:
                return delta
            self.sent += len(rest) - len(stripped)
            self.state = "answer"
        rest = current_text[self.sent :]
        self.sent = len(current_text)
        delta.content = rest or None
        return delta


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1 and its distills: reasoning from the first token to ``</think>``."""

    name = "deepseek_r1"
    priority = 10
    opens_in_reasoning = True


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3 / QwQ: reasoning only inside a ``<think>`` block that opens the output."""

    name = "qwen3"
    priority = 5
    opens_in_reasoning = False


@hookimpl
def engine_reasoning_parsers() -> list[type]:
    return [DeepSeekR1ReasoningParser, Qwen3ReasoningParser]
