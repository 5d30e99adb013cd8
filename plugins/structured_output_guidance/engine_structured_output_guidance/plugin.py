"""The guidance structured-output backend: constraints become llguidance grammars (JSON schema, regex, Lark —
a GBNF/EBNF grammar is converted to Lark — and choice); each request gets an LLMatcher that fills the token
bitmask."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import numpy as np

from engine import hookimpl
from engine.interfaces.structured_output import StructuredOutputBackend, StructuredOutputGrammar

ENGINE_CONTRACT_VERSION = "1.7"

# compact JSON: no free whitespace between tokens, so a small model cannot spend its budget on blank lines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that leaves it unset (as xgrammar's
    strict mode does): a model is not invited to invent keys until its token budget runs out."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {
        key: value if key in ("enum", "const", "default", "examples") else closed_objects(value)
        for key, value in schema.items()
    }
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def guidance_grammar(params) -> str:
    """The llguidance grammar (serialized) of a constraint; never raises, ``validate_grammar`` checks it."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if params.kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        return LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if params.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if params.kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if params.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    grammar = params.grammar
    if "::=" in grammar:  # GBNF / EBNF, as xgrammar takes it
        grammar = gbnf_to_lark(grammar)
    return LLMatcher.grammar_from_lark(grammar)


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's llguidance LLMatcher."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self.matcher.consume_tokens(token_ids)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()  # no continuation but the stop token: the answer is complete

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        return token_ids[: self.matcher.validate_tokens(token_ids)]  # llguidance checks without advancing


class GuidanceBackend(StructuredOutputBackend):
    """llguidance (https://github.com/guidance-ai/llguidance): Lark grammars, and JSON schemas with a broad
    keyword coverage."""

    name = "guidance"
    priority = 5

    @classmethod
    def unavailable_reasons(cls, ctx) -> list[str]:
        if importlib.util.find_spec("llguidance") is None:
            return ["llguidance is not installed (pip install llguidance)"]
        return []

    @classmethod
    def validate(cls, params) -> None:
        from llguidance import LLMatcher

        super().validate(params)
        try:
            error = LLMatcher.validate_grammar(guidance_grammar(params))
        except Exception as exc:
            error = str(exc)
        if error and not error.startswith("WARNING"):
            raise ValueError(
                f"the guidance structured-output backend cannot compile this {params.kind} constraint: {error.strip()}"
            )

    def __init__(self, vllm_config, tokenizer, vocab_size, eos_token_id):
        import llguidance.hf

        super().__init__(vllm_config, tokenizer, vocab_size, eos_token_id)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)

    def compile_grammar(self, params) -> Any:
        from llguidance import LLMatcher

        grammar = guidance_grammar(params)
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(error)
        return grammar

    def new_matcher(self, compiled: Any) -> GuidanceGrammar:
        from llguidance import LLMatcher

        return GuidanceGrammar(LLMatcher(self.ll_tokenizer, compiled, log_level=0))


@hookimpl
def engine_structured_output_backends() -> list[type]:
    return [GuidanceBackend]
