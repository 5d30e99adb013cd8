"""The hermes tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text
(Hermes, Qwen2.5 / Qwen3 and many other chat templates use it)."""

from __future__ import annotations

import json
import re
from typing import Optional

from engine.hookspecs import hookimpl
from engine.interfaces.tool_parser import DeltaMessage, ExtractedToolCalls, ToolCall, ToolParser

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


def parse_call(body: str) -> Optional[ToolCall]:
    """A call from the JSON between the tags, or None when it is not ``{"name": str, "arguments": ...}``."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _partial_tag_length(text: str) -> int:
    """How many characters at the end of ``text`` could begin a ``<tool_call>`` tag."""
    for length in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]):
            return length
    return 0


class HermesToolParser(ToolParser):
    """Parses ``<tool_call>`` JSON blocks; text before the first block is the message content."""

    name = "hermes"
    priority = 10

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.sent_chars = 0  # characters of the answer already sent as content or consumed by tool calls
        self.num_calls = 0

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(text, [])
        calls = [parse_call(match.group(1)) for match in _CALL.finditer(text)]
        if not calls or any(call is None for call in calls):
            return ExtractedToolCalls(text, [])  # not a well-formed call: the model's words stay its answer
        content = text[: text.index(START)].strip()
        return ExtractedToolCalls(content or None, [call for call in calls if call is not None])

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool
    ) -> Optional[DeltaMessage]:
        delta = DeltaMessage()
        content_parts: list[str] = []
        while self.sent_chars < len(current_text):
            rest = current_text[self.sent_chars :]
            start = rest.find(START)
            if start < 0:  # plain text, less a tail that may open a tag
                hold = 0 if finished else _partial_tag_length(rest)
                content_parts.append(rest[: len(rest) - hold])
                self.sent_chars += len(rest) - hold
                break
            if start:
                content_parts.append(rest[:start])
                self.sent_chars += start
                continue
            end = rest.find(END)
            if end < 0 and not finished:
                break  # a call still being written: sent whole once it closes
            body = rest[len(START) : end if end >= 0 else len(rest)]
            call = parse_call(body.strip())
            consumed = end + len(END) if end >= 0 else len(rest)
            if call is None:
                content_parts.append(rest[:consumed])
            else:
                delta.tool_calls.append(call.to_openai(self.num_calls))
                self.num_calls += 1
            self.sent_chars += consumed
        text = "".join(content_parts)
        if self.num_calls and not text.strip():
            text = ""  # the whitespace between calls is not an answer
        delta.content = text or None
        return delta if delta.content or delta.tool_calls else None


@hookimpl
def engine_tool_parsers() -> list[type]:
    return [HermesToolParser]
