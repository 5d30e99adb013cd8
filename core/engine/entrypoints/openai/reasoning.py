"""Reasoning output in the API: one choice's text split into reasoning and answer by the configured parser."""

from __future__ import annotations

from typing import Any, Optional

from engine.sampling_params import StructuredOutputsParams


def splits_reasoning(constraint: Optional[StructuredOutputsParams]) -> bool:
    """Whether an output under ``constraint`` can hold reasoning: a JSON constraint (a JSON response format, a named
    or required tool choice) makes the whole output the answer; a regex, grammar or choice may write the reasoning
    itself, and an unconstrained output is split."""
    return constraint is None or (constraint.json is None and not constraint.json_object)


class ReasoningSplitter:
    """Splits one choice's output with the reasoning parser (``server.reasoning_parser``); without one, the whole
    output is the answer. Tool-call parsing and ``content`` then see the answer only."""

    def __init__(self, parser_cls: Optional[type], tokenizer: Any):
        self.parser = parser_cls(tokenizer) if parser_cls is not None else None
        self.answer = ""  # streaming: the answer text so far

    @property
    def active(self) -> bool:
        return self.parser is not None

    def split(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning or None, answer) of a finished output."""
        if self.parser is None:
            return None, text
        reasoning, answer = self.parser.extract_reasoning(text)
        return reasoning, answer or ""

    def stream(self, current_text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning text, new answer text) that the output so far adds; ``self.answer`` grows."""
        if self.parser is None:
            new_answer = current_text[len(self.answer) :]
            self.answer = current_text
            return "", new_answer
        delta = self.parser.extract_reasoning_streaming(current_text, finished)
        self.answer += delta.content or ""
        return delta.reasoning_content or "", delta.content or ""
