"""SamplingParams: what a request asks of generation, with vLLM's field names and validation."""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import msgspec

from engine.errors import InvalidParameterError

GREEDY_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what crosses the engine-core boundary (msgpack) and torch


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


def _is_int64(value: Any) -> bool:
    return value is None or (isinstance(value, int) and INT64_MIN <= value <= INT64_MAX)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_TOO_DEEP = object()
MAX_SCHEMA_DEPTH = 128  # nesting of a JSON schema's objects and arrays (deeper ones overflow parsers' stacks)


def _nesting_depth(value: Any) -> int:
    """How deeply dicts and lists nest in ``value`` (iterative: a hostile value cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on a request's output (vLLM's name): exactly one of ``json`` (a JSON schema, as a dict or
    its text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF for xgrammar, Lark
    for guidance) or ``json_object=True`` (any JSON object). The structured-output backend plugin enforces it
    with a token bitmask applied before sampling."""

    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}",
                "structured_outputs",
            )
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameterError(
                "StructuredOutputsParams.choice must be a non-empty list of non-empty strings",
                "structured_outputs.choice",
            )
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidParameterError(
                    f"StructuredOutputsParams.{field} must be a non-empty string", f"structured_outputs.{field}"
                )
        if isinstance(self.json, str):
            import json as json_module

            try:
                parsed = json_module.loads(self.json)
            except RecursionError:
                parsed = _TOO_DEEP  # nested past the parser's stack: refused below
            except ValueError as exc:
                raise InvalidParameterError(
                    f"StructuredOutputsParams.json is not valid JSON: {exc}", "structured_outputs.json"
                ) from None
            if not isinstance(parsed, (dict, bool)) and parsed is not _TOO_DEEP:
                raise InvalidParameterError(
                    "StructuredOutputsParams.json must be a JSON schema (an object)", "structured_outputs.json"
                )
        else:
            parsed = self.json
        if self.json is not None and (parsed is _TOO_DEEP or _nesting_depth(parsed) > MAX_SCHEMA_DEPTH):
            raise InvalidParameterError(
                f"StructuredOutputsParams.json nests deeper than {MAX_SCHEMA_DEPTH} levels", "structured_outputs.json"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))

    def spec(self) -> str:
        """The constraint as one string (a JSON schema as canonical JSON): with ``kind``, the compile cache's key."""
        import json as json_module

        value = getattr(self, self.kind)
        if self.kind == "json":
            return json_module.dumps(json_module.loads(value) if isinstance(value, str) else value, sort_keys=True)
        if self.kind == "choice":
            return json_module.dumps(value)
        return "" if self.kind == "json_object" else value


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Generation settings of one request. Invalid values raise InvalidParameterError (a ValueError) naming the field.

    Penalties follow vLLM: ``presence_penalty`` and ``frequency_penalty`` act on the tokens generated
    so far, ``repetition_penalty`` on prompt and generated tokens (>1 discourages repeats).
    ``logprobs=k`` returns the sampled token's logprob and rank plus the top-k, from the model's raw
    distribution; ``prompt_logprobs=k`` does the same for every prompt token after the first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    skip_prefix_cache: bool = False
    extra_args: Optional[dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Filled by the input processor from ``bad_words`` with the model's tokenizer.
    bad_words_token_ids: Optional[list[list[int]]] = None
    # a reasoning model's thinking budget (vLLM's): after this many reasoning tokens the reasoning is closed
    thinking_token_budget: Optional[int] = None
    # Filled by the input processor from the reasoning parser's tags: what opens the reasoning (empty: the output
    # starts in it) and what closes it (forced when the budget is spent)
    reasoning_start_token_ids: list[int] = []
    reasoning_end_token_ids: list[int] = []

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise InvalidParameterError(
                    f"SamplingParams.logit_bias must map token ids to numbers, got {self.logit_bias!r}", "logit_bias"
                ) from None
        for field in (
            "n",
            "top_k",
            "seed",
            "max_tokens",
            "min_tokens",
            "logprobs",
            "prompt_logprobs",
            "thinking_token_budget",
        ):
            if not _is_int64(getattr(self, field)):
                raise InvalidParameterError(
                    f"SamplingParams.{field} must be an integer in [{INT64_MIN}, {INT64_MAX}], "
                    f"got {getattr(self, field)!r}",
                    field,
                )
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be non-negative"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (off), 0 (off) or positive"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "must be in (0, 10]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            (
                "thinking_token_budget",
                self.thinking_token_budget is None or self.thinking_token_budget >= 0,
                "must be non-negative",
            ),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens, "must not exceed max_tokens"),
            ("stop_token_ids", all(_is_token_id(t) for t in self.stop_token_ids), "must be non-negative token ids"),
            (
                "logit_bias",
                self.logit_bias is None or all(_is_token_id(t) for t in self.logit_bias),
                "must map non-negative token ids to biases",
            ),
            (
                "logit_bias",
                self.logit_bias is None or all(math.isfinite(b) for b in self.logit_bias.values()),
                "must hold finite biases",
            ),
            (
                "stop",
                self.stop is None or all(isinstance(s, str) and s for s in self.stop),
                "must be non-empty strings",
            ),
            ("stop", not self.stop or self.detokenize, "needs detokenize=True"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be non-negative"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be non-negative"),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None
                or (len(self.allowed_token_ids) > 0 and all(_is_token_id(t) for t in self.allowed_token_ids)),
                "must be a non-empty list of token ids",
            ),
            (
                "bad_words",
                self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words),
                "must be non-empty strings",
            ),
            (
                "bad_words",
                self.bad_words is None or all(not isinstance(w, str) or _encodable(w) for w in self.bad_words),
                "must be valid Unicode (no lone surrogates)",
            ),
            (
                "stop",
                self.stop is None or all(not isinstance(s, str) or _encodable(s) for s in self.stop),
                "must be valid Unicode (no lone surrogates)",
            ),
        ]
        for field, ok, message in checks:
            if not ok:
                raise InvalidParameterError(f"SamplingParams.{field} {message}, got {getattr(self, field)!r}", field)
        if self.prompt_logprobs is not None:
            self.skip_prefix_cache = True  # every prompt position must be computed to score it

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def for_child(self, index: int) -> SamplingParams:
        """The settings of sequence ``index`` of an n>1 request: n=1, and its own seed if seeded."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN  # stays int64
        return msgspec.structs.replace(self, n=1, seed=seed)

    def validate_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids inside the vocabulary, logprob counts."""
        for field, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
            ("bad_words", [t for seq in self.bad_words_token_ids or [] for t in seq]),
            ("thinking_token_budget", self.reasoning_start_token_ids + self.reasoning_end_token_ids),
        ):
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise InvalidParameterError(
                    f"SamplingParams.{field} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", field
                )
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and value > max_logprobs:
                raise InvalidParameterError(
                    f"SamplingParams.{field}={value} exceeds the server's max_logprobs={max_logprobs}", field
                )


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode that UTF-8 can carry (JSON allows lone surrogates; tokenizers don't)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
