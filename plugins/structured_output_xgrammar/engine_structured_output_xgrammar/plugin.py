"""The xgrammar structured-output backend: JSON schema, regex, EBNF grammar and choice constraints compiled with
xgrammar against the model's tokenizer; each request gets a GrammarMatcher that fills the token bitmask."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import numpy as np

from engine import hookimpl
from engine.interfaces.structured_output import StructuredOutputBackend, StructuredOutputGrammar

ENGINE_CONTRACT_VERSION = "1.7"

# JSON-schema keywords xgrammar accepts but does not enforce: refused (400) rather than served unenforced
UNENFORCED_JSON_KEYWORDS = (
    "multipleOf",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "patternProperties",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "if",
    "then",
    "else",
    "not",
)


def unenforced_keywords(schema: Any) -> list[str]:
    """The keywords of ``schema`` (at any depth) that xgrammar would not enforce."""
    found: list[str] = []
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in UNENFORCED_JSON_KEYWORDS and key not in found:
                found.append(key)
            if key not in ("enum", "const", "default", "examples"):
                found += [k for k in unenforced_keywords(value) if k not in found]
    elif isinstance(schema, list):
        for item in schema:
            found += [k for k in unenforced_keywords(item) if k not in found]
    return found


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def json_schema(params) -> Any:
    return json.loads(params.json) if isinstance(params.json, str) else params.json


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar GrammarMatcher."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(self.matcher.accept_token(token_id) for token_id in token_ids)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        import torch

        self.matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XgrammarBackend(StructuredOutputBackend):
    """xgrammar (https://github.com/mlc-ai/xgrammar): the default backend. JSON is generated compact (no free
    whitespace between tokens, so a small model cannot spend its budget on blank lines)."""

    name = "xgrammar"
    priority = 10

    @classmethod
    def unavailable_reasons(cls, ctx) -> list[str]:
        if importlib.util.find_spec("xgrammar") is None:
            return ["xgrammar is not installed (pip install xgrammar)"]
        return []

    @classmethod
    def validate(cls, params) -> None:
        import xgrammar

        super().validate(params)
        try:
            if params.kind == "json":
                schema = json_schema(params)
                unenforced = unenforced_keywords(schema)
                if unenforced:
                    raise ValueError(
                        f"the xgrammar structured-output backend does not enforce the JSON-schema "
                        f"keywords {unenforced}; remove them or serve with "
                        "structured_outputs.backend=guidance"
                    )
                xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
            elif params.kind == "regex":
                xgrammar.Grammar.from_regex(params.regex)
            elif params.kind == "grammar":
                xgrammar.Grammar.from_ebnf(params.grammar)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError (and its own errors) for what it cannot parse
            raise ValueError(
                f"the xgrammar structured-output backend cannot compile this {params.kind} "
                f"constraint: {str(exc).strip()}"
            ) from None

    def __init__(self, vllm_config, tokenizer, vocab_size, eos_token_id):
        import xgrammar

        super().__init__(vllm_config, tokenizer, vocab_size, eos_token_id)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[eos_token_id] if eos_token_id is not None else None
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile_grammar(self, params) -> Any:
        if params.kind == "json":
            return self.compiler.compile_json_schema(json.dumps(json_schema(params)), any_whitespace=False)
        if params.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if params.kind == "regex":
            return self.compiler.compile_regex(params.regex)
        if params.kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(params.choice))
        return self.compiler.compile_grammar(params.grammar)

    def new_matcher(self, compiled: Any) -> XgrammarGrammar:
        import xgrammar

        return XgrammarGrammar(xgrammar.GrammarMatcher(compiled))


@hookimpl
def engine_structured_output_backends() -> list[type]:
    return [XgrammarBackend]
