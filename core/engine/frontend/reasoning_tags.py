"""The token ids of a reasoning parser's tags (a thinking budget forces the closing one)."""

from __future__ import annotations

from typing import Any

from engine.interfaces.reasoning_parser import ReasoningParser


def reasoning_tag_token_ids(parser_cls: type[ReasoningParser], tokenizer: Any) -> tuple[list[int], list[int]]:
    """(what opens the reasoning, what closes it) as token ids; the opening is empty when the output starts in it."""
    start = (
        []
        if parser_cls.reasoning_starts_at_output()
        else tokenizer.encode(parser_cls.start_text, add_special_tokens=False)
    )
    return start, tokenizer.encode(parser_cls.end_text, add_special_tokens=False)
