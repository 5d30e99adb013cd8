"""The configured reasoning parser (``server.reasoning_parser``) and the token ids of its tags."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from engine.interfaces.base import SelectionContext
from engine.interfaces.reasoning_parser import ReasoningParser
from engine.plugins import get_plugin_manager

if TYPE_CHECKING:
    from engine.config import VllmConfig


def select_reasoning_parser(vllm_config: VllmConfig) -> Optional[type[ReasoningParser]]:
    """The configured reasoning parser class, or None when ``server.reasoning_parser`` is ``none``."""
    name = vllm_config.server.reasoning_parser
    if name == "none":
        return None
    return get_plugin_manager().select("reasoning_parser", name, SelectionContext(vllm_config)).cls


def reasoning_tag_token_ids(parser_cls: type[ReasoningParser], tokenizer: Any) -> tuple[list[int], list[int]]:
    """(what opens the reasoning, what closes it) as token ids; the opening is empty when the output starts in it."""
    start = (
        []
        if parser_cls.reasoning_starts_at_output()
        else tokenizer.encode(parser_cls.start_text, add_special_tokens=False)
    )
    return start, tokenizer.encode(parser_cls.end_text, add_special_tokens=False)
