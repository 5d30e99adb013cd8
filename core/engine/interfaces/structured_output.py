"""Structured-output interface: a grammar engine that constrains sampling with a token bitmask.

A backend compiles a request's constraint (``StructuredOutputsParams``) against the model's tokenizer into a
compiled grammar that the engine caches per distinct constraint, and makes one ``StructuredOutputGrammar``
(a matcher) per request from it. Every step the scheduler asks each constrained request's matcher for the
tokens allowed next (a row of a packed int32 bitmask: bit ``t % 32`` of word ``t // 32`` set when token ``t``
may follow); the model runner masks the other tokens' logits before sampling; the sampled tokens are then fed
back with ``accept_tokens``. With speculative decoding a request's drafts are first cut to the prefix its grammar
allows (``validate_tokens``), and it gets one bitmask row per position: the matcher accepts each draft to fill
the next row, then ``rollback`` returns it to where it stood.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class StructuredOutputGrammar(ABC):
    """One request's matcher: where its output stands in the grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and no advance past the first refused token) if one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words, see the module docstring)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has ended (its stop token was accepted): the request stops."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar allows from here, without advancing (a backend with a
        native check overrides this; the default accepts them one by one and rolls back)."""
        num_valid = 0
        for token_id in token_ids:
            if self.is_terminated() or not self.accept_tokens([token_id]):
                break
            num_valid += 1
        if num_valid:
            self.rollback(num_valid)
        return token_ids[:num_valid]


class StructuredOutputBackend(Pluggable):
    """A grammar engine (xgrammar, llguidance...), chosen by ``structured_outputs.backend``.

    ``validate(params)`` is a classmethod run in the front end before a request is accepted: it raises
    ``ValueError`` naming the problem when the constraint is invalid or one this backend cannot express (the
    server answers 400). In the engine-core process the backend is constructed once, on the first constrained
    request, as ``cls(vllm_config, tokenizer, vocab_size, eos_token_id)``; ``compile_grammar`` runs on a
    worker thread (it must not touch shared state unguarded), ``new_matcher`` on the engine core's loop.
    """

    #: the request kinds this backend can compile (a subset of json, regex, choice, grammar, json_object)
    supported_kinds: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")

    def __init__(self, vllm_config: VllmConfig, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int]):
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem unless this backend can compile ``params``."""
        if params.kind not in cls.supported_kinds:
            raise ValueError(f"the {cls.name} structured-output backend cannot express a {params.kind} constraint")

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """Compile a constraint against the tokenizer (runs on a worker thread; the result is cached)."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled grammar, for one request."""
