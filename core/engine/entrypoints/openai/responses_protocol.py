"""The Responses API's request body (``POST /v1/responses``) and how its ``input`` items become a conversation."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import (
    ChatCompletionTool,
    Count,
    FunctionDefinition,
    Int64,
    NamedFunction,
    NamedToolChoice,
    StructuredOutputsRequest,
    _Request,
)
from engine.sampling_params import StructuredOutputsParams

TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


class ResponsesFunctionTool(_Request):
    """A function tool, in the Responses API's flat form (``name`` and ``parameters`` beside ``type``)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    def as_chat_tool(self) -> ChatCompletionTool:
        return ChatCompletionTool(
            function=FunctionDefinition(
                name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
            )
        )


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON matching a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    def constraint(self) -> Optional[StructuredOutputsParams]:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError("text.format of type json_schema needs a schema", 400, "text.format.schema")
            return StructuredOutputsParams(json=self.json_schema)
        return None


class TextConfig(_Request):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted; no effect here


class ReasoningConfig(_Request):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort``; summaries are not written."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(_Request):
    """``POST /v1/responses`` (OpenAI's fields that this server serves; others answer 400 naming them)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[Count] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None  # "auto" (drop old turns to fit) is not served
    background: Optional[bool] = None  # true is not served (responses run while their request is open)
    include: Optional[list[str]] = None  # "reasoning.encrypted_content" only: reasoning is returned in clear
    stream_options: Optional[dict[str, Any]] = None  # include_obfuscation: no effect (nothing is padded)
    # OpenAI fields without effect here
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    # vLLM's extras
    top_k: Optional[Int64] = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[Int64] = None
    priority: Int64 = 0
    chat_template_kwargs: Optional[dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None

    @field_validator("background")
    @classmethod
    def _foreground_only(cls, value: Optional[bool]) -> Optional[bool]:
        if value:
            raise ValueError("background responses are not served here (leave it unset or false)")
        return value

    @field_validator("include")
    @classmethod
    def _served_includes(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        unserved = sorted(set(value or ()) - {"reasoning.encrypted_content"})
        if unserved:
            raise ValueError(f"{unserved} are not served here (reasoning.encrypted_content is accepted)")
        return value

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The output constraint of ``text.format`` or vLLM's ``structured_outputs`` (at most one)."""
        from_format = self.text.format.constraint() if self.text is not None and self.text.format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise APIError(
                "text.format and structured_outputs both constrain the output; give one", 400, "structured_outputs"
            )
        return self.structured_outputs.constraint() if self.structured_outputs is not None else from_format

    def chat_tools(self) -> list[ChatCompletionTool]:
        return [tool.as_chat_tool() for tool in self.tools or []]

    def chat_tool_choice(self) -> Optional[Union[str, NamedToolChoice]]:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return NamedToolChoice(function=NamedFunction(name=self.tool_choice.name))
        return self.tool_choice

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning.effort)
        return kwargs


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined (other parts answer 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts", 400, where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                f"{where}[{index}]: content part of type {kind!r} is not served here (text parts only: "
                f"{', '.join(TEXT_PARTS)})",
                400,
                f"{where}[{index}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def conversation_of(items: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Chat-template messages from a Responses ``input``: messages, function calls (an assistant turn with
    ``tool_calls``) and their outputs (``tool`` turns); reasoning items are not shown to the model again.
    Anything else answers 400 naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    f"{where}.role must be user, assistant, system or developer, got {role!r}", 400, f"{where}.role"
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(arguments, str) and isinstance(call_id, str)):
                raise APIError(f"{where}: a function_call needs name, arguments and call_id strings", 400, where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(f"{where}: a function_call_output needs its call_id", 400, f"{where}.call_id")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(
                f"{where}: input item of type {kind!r} is not served here (message, function_call, "
                "function_call_output and reasoning are)",
                400,
                f"{where}.type",
            )
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the conversation turns they add (for ``previous_response_id``)."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"role": "assistant", "content": "".join(part["text"] for part in item["content"])})
        elif item["type"] == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "name": item["name"],
                    "arguments": item["arguments"],
                    "call_id": item["call_id"],
                }
            )
    return conversation_of(items)
