"""Tools for plugin authors and this repository's tests: tiny random models, transformers references,
kernel-level attention checks, and the conformance suite (``engine.testing.conformance``)."""
from engine.testing.models import hf_greedy, make_tiny_model, random_prompts, tokenizer_folder

__all__ = ["hf_greedy", "make_tiny_model", "random_prompts", "tokenizer_folder"]
