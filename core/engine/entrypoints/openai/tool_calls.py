"""Tool calls in chat: how ``tools`` and ``tool_choice`` shape a request's output and its answer.

- ``"none"``: the tools are not shown; the answer is text.
- a named function: the output is constrained to the JSON schema of its parameters and answered as one
  ``tool_calls`` entry (streamed as argument deltas).
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` calls of the given
  tools (vLLM's scheme), answered as ``tool_calls``.
- ``"auto"`` (the default when tools are given): the model decides, in its own format; the tool-call parser
  plugin chosen by ``server.tool_call_parser`` (``hermes`` built in) turns its text into ``tool_calls``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

from engine.entrypoints.openai.errors import APIError
from engine.interfaces.tool_parser import DeltaMessage, ToolCall, ToolParser
from engine.plugins import configured_class
from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.entrypoints.openai.protocol import ChatCompletionTool, NamedToolChoice

ANY_OBJECT = {"type": "object"}


class ToolRequest(Protocol):
    """What a tool plan reads of a request: a chat completion's body, or ``ToolFields`` (the Responses API)."""

    @property
    def tools(self) -> Optional[list[ChatCompletionTool]]: ...

    @property
    def tool_choice(self) -> Optional[Union[str, NamedToolChoice]]: ...

    @property
    def parallel_tool_calls(self) -> Optional[bool]: ...


@dataclass
class ToolFields:
    """The tool fields of a request that is not a chat completion, in the chat form."""

    tools: Optional[list[ChatCompletionTool]]
    tool_choice: Optional[Union[str, NamedToolChoice]]
    parallel_tool_calls: Optional[bool]


def select_tool_parser(vllm_config: VllmConfig) -> Optional[type]:
    """The configured tool-call parser class, or None when ``server.tool_call_parser`` is ``none``."""
    return configured_class("tool_parser", vllm_config)


class ToolCallPlan:
    """What a chat request's ``tools`` / ``tool_choice`` ask for; 400 (APIError) for an inconsistent pair."""

    def __init__(self, body: ToolRequest, parser_cls: Optional[type]):
        self.tools = {tool.function.name: tool.function for tool in body.tools or []}
        self.parallel = body.parallel_tool_calls is not False
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if self.tools else "none")
        self.function_name = ""  # the named function (mode "named" only)
        self.mode: str
        if isinstance(choice, str):
            self.mode = choice
        else:
            self.mode, self.function_name = "named", choice.function.name
        if self.mode != "none" and not self.tools:
            raise APIError(f"tool_choice {self.mode!r} needs tools", 400, "tool_choice")
        if self.mode == "named" and self.function_name not in self.tools:
            raise APIError(
                f"tool_choice names the function {self.function_name!r}, which is not among the tools "
                f"{sorted(self.tools)}",
                400,
                "tool_choice",
            )
        if self.mode == "auto" and parser_cls is None:
            raise APIError(
                'tool_choice "auto" (the default when tools are given) needs a tool-call parser: start the '
                "server with --tool-call-parser hermes (server.tool_call_parser), or ask for "
                'tool_choice "required", a named function or "none"',
                400,
                "tool_choice",
            )
        self.parser_cls = parser_cls if self.mode == "auto" else None
        self.template_tools = (
            [
                {"type": "function", "function": function.model_dump(exclude_none=True)}
                for function in self.tools.values()
            ]
            if self.mode != "none"
            else None
        )

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The output constraint of a named or required tool choice."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.tools[self.function_name].parameters or ANY_OBJECT)
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": function.parameters or ANY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                }
                for name, function in self.tools.items()
            ]
            array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            return StructuredOutputsParams(json=array if self.parallel else {**array, "maxItems": 1})
        return None

    def output_constraint(
        self, requested: Optional[StructuredOutputsParams], requested_by: str
    ) -> Optional[StructuredOutputsParams]:
        """The request's output constraint: the tool choice's, or ``requested`` (the request's own, named by
        ``requested_by``); a 400 when both constrain the output."""
        constraint = self.constraint()
        if constraint is None:
            return requested
        if requested is not None:
            raise APIError(
                f"tool_choice {self.mode!r} constrains the output to a tool call; it cannot be combined with "
                f"{requested_by}",
                400,
                "tool_choice",
            )
        return constraint

    def message(self, text: str, tokenizer) -> tuple[dict[str, Any], bool]:
        """(the assistant message for a finished answer, whether it holds tool calls)."""
        calls: list[ToolCall] = []
        content: Optional[str] = text
        if self.mode == "named":
            calls, content = [ToolCall(self.function_name, text)], None
        elif self.mode == "required":
            parsed = parse_required_calls(text)
            if parsed is not None:
                calls, content = parsed, None
        elif self.mode == "auto":
            assert self.parser_cls is not None  # refused above without one
            extracted = self.parser_cls(tokenizer).extract_tool_calls(text)
            calls, content = extracted.tool_calls[: None if self.parallel else 1], extracted.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, bool(calls)

    def finish_reason(self, reason: Optional[str], called: bool) -> Optional[str]:
        """OpenAI's finish reason: ``tool_calls`` when the model chose to call (auto, required)."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def streamer(self, tokenizer) -> ToolCallStreamer:
        return ToolCallStreamer(self, tokenizer)


def call_from_item(item: Any) -> Optional[ToolCall]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    return ToolCall(item["name"], json.dumps(item.get("parameters", {})))


def parse_required_calls(text: str) -> Optional[list[ToolCall]]:
    """The calls of a ``required`` answer (a JSON array), or None when it is not one (cut by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_item(item) for item in items]
    return [call for call in calls if call is not None] if None not in calls else None


class ToolCallStreamer:
    """Turns one streamed choice's text deltas into chat deltas (content or tool_calls)."""

    def __init__(self, plan: ToolCallPlan, tokenizer):
        self.plan = plan
        self.parser: Optional[ToolParser] = plan.parser_cls(tokenizer) if plan.parser_cls is not None else None
        self.call_id: Optional[str] = None
        self.num_calls = 0
        self.scan = 0  # required: where the next array element starts
        self.decoder = json.JSONDecoder()

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def delta(self, text: str, previous_text: str, current_text: str, finished: bool) -> dict[str, Any]:
        """The ``delta`` object of a chunk carrying ``text``."""
        mode = self.plan.mode
        if mode == "none":
            return {"content": text} if text else {}
        if mode == "named":
            if self.call_id is None:
                call = ToolCall(self.plan.function_name, text)
                self.call_id, self.num_calls = call.id, 1
                return {"tool_calls": [call.to_openai(0)]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if mode == "required":
            return self._required_delta(current_text, finished)
        assert self.parser is not None  # auto always has one (ToolCallPlan refuses auto without a parser)
        found: Optional[DeltaMessage] = self.parser.extract_tool_calls_streaming(
            previous_text, current_text, text, finished
        )
        if found is None:
            return {}
        self.num_calls += len(found.tool_calls)
        delta: dict[str, Any] = {}
        if found.content:
            delta["content"] = found.content
        if found.tool_calls:
            delta["tool_calls"] = found.tool_calls
        return delta

    def _required_delta(self, current_text: str, finished: bool) -> dict[str, Any]:
        """Each element of the JSON array is sent as a call once it is complete."""
        calls = []
        while True:
            position = self.scan
            while position < len(current_text) and current_text[position] in " \t\n\r[,":
                position += 1
            try:
                item, end = self.decoder.raw_decode(current_text, position)
            except ValueError:
                break
            call = call_from_item(item)
            if call is None:
                break
            calls.append(call.to_openai(self.num_calls))
            self.num_calls += 1
            self.scan = end
        if finished and not self.num_calls and not calls and current_text:
            return {"content": current_text}  # never became a call (cut by max_tokens): the text is the answer
        return {"tool_calls": calls} if calls else {}
