"""Tools for plugin authors and this repository's tests: tiny random models, transformers references,
kernel-level attention checks, ``inspect(llm)`` (an engine's parts by name), and the conformance suite
(``engine.testing.conformance``)."""

from engine.testing.inspection import EngineInspector, inspect
from engine.testing.models import hf_greedy, make_tiny_model, random_prompts, tokenizer_folder

__all__ = ["EngineInspector", "hf_greedy", "inspect", "make_tiny_model", "random_prompts", "tokenizer_folder"]
