"""OpenAI request bodies (plus vLLM's sampling extras) and their mapping onto SamplingParams."""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.errors import InvalidParameterError
from engine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("engine.server")

# Every integer is bounded where it enters: nothing out of range reaches msgpack, torch or the core.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
MAX_N = 128  # OpenAI's bound on `n`: each sequence is a request of its own in the engine core
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias


def find_lone_surrogate(value: Any, path: str = "") -> Optional[str]:
    """The path of the first string that UTF-8 cannot carry (JSON's \\udcff escapes allow them)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, path) or find_lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}.{index}" if path else str(index))
            if found:
                return found
    return None


# Documented OpenAI fields that change nothing here (accounting, storage, routing): accepted, logged once.
NO_EFFECT_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
_logged_no_effect: set[str] = set()


class _Request(BaseModel):
    """Base of every request body: no unknown field (a misspelt or unsupported option answers 400 naming it,
    never fails open), no NaN or infinity, no string that is not valid Unicode."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where:
            raise ValueError(f"{where}: strings must be valid Unicode (lone surrogate escapes are not)")
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = "response"
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self

    def constraint(self) -> Optional[StructuredOutputsParams]:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:  # the validator requires it
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` body field: exactly one of json, regex, choice, grammar, json_object."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar, json_object=self.json_object
        )


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[Int64] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # OpenAI fields without effect here (NO_EFFECT_FIELDS)
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    # vLLM's extras
    top_k: Optional[Int64] = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Optional[list[TokenId]] = None
    bad_words: Optional[list[str]] = None
    cache_salt: Optional[str] = None
    priority: Int64 = 0  # lower first; needs the server's --scheduling-policy priority
    # a reasoning model's thinking budget: the reasoning is closed after this many tokens (needs a reasoning parser)
    thinking_token_budget: Optional[Count] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # vLLM's name: SamplingParams.extra_args, read by third-party logits processors
    vllm_xargs: Optional[
        dict[str, Union[str, Int64, float, bool, None, list[Union[str, Int64, float, bool, None]]]]
    ] = None

    @model_validator(mode="after")
    def _log_no_effect_fields(self) -> _SamplingFields:
        for name in NO_EFFECT_FIELDS:
            if getattr(self, name) is not None and name not in _logged_no_effect:
                _logged_no_effect.add(name)
                logger.info("request field %r is accepted and has no effect on this server (logged once)", name)
        return self

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (value or {}).items():
            if not key.strip().isdigit() or int(key) > INT64_MAX:
                raise ValueError(f"keys must be non-negative token ids, got {key!r}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"biases must lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} for {key!r}"
                )
        return value

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The output constraint asked for by ``response_format`` or ``structured_outputs`` (at most one)."""
        from_format = self.response_format.constraint() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise InvalidParameterError(
                "response_format and structured_outputs both constrain the output; give one of them",
                "structured_outputs",
            )
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return from_format

    def sampling_params(
        self,
        max_tokens: Optional[int],
        logprobs: Optional[int],
        default_max: int,
        constraint: Optional[StructuredOutputsParams] = None,
    ) -> SamplingParams:
        """Map onto SamplingParams (with ``constraint``, else the body's own); invalid values raise ValueError
        naming the field."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            max_tokens=max_tokens if max_tokens is not None else default_max,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            logprobs=logprobs,
            extra_args=self.vllm_xargs,
            structured_outputs=constraint if constraint is not None else self.constraint(),
            thinking_token_budget=self.thinking_token_budget,
        )


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Optional[Count] = 16
    logprobs: Optional[Count] = None
    echo: bool = False
    suffix: Optional[str] = None
    # vLLM's beam search: the best n beams (n is the beam width), ranked with length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0


Role = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id... pass to the chat template

    role: Role
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: bool = False
    top_logprobs: Optional[Count] = None
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one call (tool_choice "required" and "auto")
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra template variables, e.g. enable_thinking
    include_reasoning: bool = True  # with a reasoning parser: false leaves reasoning_content out


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[Int64]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(
    message: str, err_type: str = "BadRequestError", param: Optional[str] = None, code: int = 400
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
