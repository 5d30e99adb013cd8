"""Tokenizer (and chat template) from a Hugging Face folder or a GGUF file, through transformers."""

from __future__ import annotations

import functools
import os

from engine.model.model_info import ModelInfo


@functools.lru_cache(maxsize=4)
def _load(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    if gguf_file:
        return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(path)


def get_tokenizer(info: ModelInfo):
    """The model's tokenizer; ``model.tokenizer`` overrides where it comes from."""
    if info.tokenizer_path:
        return _load(info.tokenizer_path, None)
    if info.format == "gguf":
        return _load(os.path.dirname(info.path), os.path.basename(info.path))
    return _load(info.path, None)
