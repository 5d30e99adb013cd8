"""StructuredOutputManager: the engine core's side of structured outputs.

It picks the backend plugin when the first constrained request arrives, compiles each distinct constraint
once on a worker thread (the busy loop never waits for a compile: a request whose grammar is not ready stays
in the waiting queue while the others run), gives each request its matcher, and packs the allowed-token
bitmask of a step's constrained rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from engine.interfaces.base import SelectionContext
from engine.interfaces.structured_output import StructuredOutputBackend, StructuredOutputGrammar, bitmask_words
from engine.model.tokenizer import get_tokenizer
from engine.plugins import get_plugin_manager

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.model.model_info import ModelInfo
    from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 1024


class StructuredOutputRequest:
    """A request's constraint: its compile (shared with every request of the same constraint) and its matcher."""

    def __init__(
        self,
        params: StructuredOutputsParams,
        compiled: Future,
        manager: StructuredOutputManager,
        resumed_token_ids: Optional[list[int]] = None,
    ):
        self.params = params
        self.resumed_token_ids = list(resumed_token_ids or [])  # a migrated request's tokens: the matcher takes them
        self.compiled = compiled
        self.manager = manager
        self.grammar: Optional[StructuredOutputGrammar] = None
        self.error: Optional[str] = None

    def is_ready(self) -> bool:
        """Whether the compile has ended (then ``grammar`` or ``error`` is set); never blocks."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self.compiled.done():
            return False
        exc = self.compiled.exception()
        if exc is not None:
            self.error = f"structured output ({self.params.kind}) failed to compile: {type(exc).__name__}: {exc}"
        else:
            assert self.manager.backend is not None  # it compiled the grammar
            grammar = self.manager.backend.new_matcher(self.compiled.result())
            if self.resumed_token_ids and not grammar.accept_tokens(self.resumed_token_ids):
                self.error = "structured output: the resumed tokens do not match the grammar"
            else:
                self.grammar = grammar
        return True


class StructuredOutputManager:
    """Backend, compile thread, compiled-grammar cache and bitmask packing for one engine core."""

    def __init__(self, vllm_config: VllmConfig, model_info: ModelInfo):
        self.vllm_config = vllm_config
        self.model_info = model_info
        self.vocab_size = model_info.vocab_size
        self.backend: Optional[StructuredOutputBackend] = None  # chosen and built on the first constrained request
        self._compiler: Optional[ThreadPoolExecutor] = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []  # each finished compile's time (benchmarks report it)

    def _init_backend(self) -> None:
        requested = self.vllm_config.structured_outputs.backend
        impl = get_plugin_manager().select(
            "structured_output", requested, SelectionContext(self.vllm_config, self.model_info)
        )
        tokenizer = get_tokenizer(self.model_info)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.model_info.eos_token_id
        self.backend = impl.create(self.vllm_config, tokenizer, self.vocab_size, eos)
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        logger.info("structured outputs: backend %s from %s", impl.name, impl.source)

    def request(
        self, params: StructuredOutputsParams, resumed_token_ids: Optional[list[int]] = None
    ) -> StructuredOutputRequest:
        """A request's constraint, its compile started (or found in the cache); a migrated request's matcher
        starts after ``resumed_token_ids``. Raises ConfigError when no backend can run here."""
        if self.backend is None:
            self._init_backend()
        key = (params.kind, params.spec())
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
            else:
                assert self._compiler is not None  # made with the backend, above
                future = self._compiler.submit(self._compile, params)
                self._cache[key] = future
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return StructuredOutputRequest(params, future, self, resumed_token_ids)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        assert self.backend is not None  # compiles are submitted once it exists
        compiled = self.backend.compile_grammar(params)
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def grammar_bitmask(self, rows: list[tuple[StructuredOutputGrammar, list[int]]]) -> np.ndarray:
        """The allowed-token bitmask of one step, [sum(1 + len(drafts)), words] int32. Each (grammar, drafts)
        entry takes 1 + len(drafts) consecutive rows: the tokens its grammar allows next, then after each of its
        speculative drafts (the drafts are ones the grammar allows: see ``validate_tokens``). The matcher
        accepts the drafts to fill those rows and is rolled back after, so it ends where it started."""
        bitmask = np.full(
            (sum(1 + len(drafts) for _, drafts in rows), bitmask_words(self.vocab_size)), -1, dtype=np.int32
        )
        row = 0
        for grammar, drafts in rows:
            grammar.fill_bitmask(bitmask, row)
            num_accepted = 0
            for draft in drafts:
                if grammar.is_terminated() or not grammar.accept_tokens([draft]):
                    break  # a backend whose validate_tokens disagrees: the rows left allow every token, and a
                    # token the grammar refuses then ends that request alone, with an error
                num_accepted += 1
                if not grammar.is_terminated():  # past its end the request stops: that row is never used
                    grammar.fill_bitmask(bitmask, row + num_accepted)
            if num_accepted:
                grammar.rollback(num_accepted)
            row += 1 + len(drafts)
        return bitmask

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
