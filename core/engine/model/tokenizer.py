"""Tokenizer (and chat template) from a Hugging Face folder or a GGUF file, through transformers.

transformers builds a GGUF file's tokenizer from the vocabulary and merges in its header, which takes seconds (about
12 for SmolLM2 on a 2-core machine) in every process that loads it. The converted tokenizer is therefore saved once,
as a Hugging Face folder under ``$XDG_CACHE_HOME/engine/tokenizers/`` keyed by the file (its path, size and
modification time) and the transformers and tokenizers versions, and later loads read that folder.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile

from engine.disk_cache import engine_cache_dir
from engine.model.model_info import ModelInfo

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _load(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    if gguf_file:
        return load_gguf_tokenizer(os.path.join(path, gguf_file))
    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer_cache_folder(gguf_path: str) -> str:
    """The folder that holds (or will hold) the converted tokenizer of the GGUF file at ``gguf_path``."""
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    versions = [importlib.metadata.version(name) for name in ("transformers", "tokenizers")]
    key = "\n".join([real, str(stat.st_size), str(stat.st_mtime_ns), *versions])
    return os.path.join(engine_cache_dir("tokenizers"), hashlib.sha256(key.encode()).hexdigest()[:24])


def load_gguf_tokenizer(gguf_path: str):
    """The GGUF file's tokenizer: from the cache folder when an earlier load saved it there, else converted by
    transformers and saved (a cache that cannot be read or written is skipped with a warning)."""
    from transformers import AutoTokenizer

    folder = gguf_tokenizer_cache_folder(gguf_path)
    if os.path.isdir(folder):
        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception as exc:  # a damaged entry: convert again and replace it
            logger.warning("tokenizer cache %s unreadable (%s): converting the GGUF tokenizer again", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    _save_atomically(tokenizer, folder)
    return tokenizer


def _save_atomically(tokenizer, folder: str) -> None:
    """Save into a temporary sibling, then rename it into place: a reader never sees half a folder, and of two
    processes saving at once the first rename wins."""
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".saving-", dir=os.path.dirname(folder))
    except OSError as exc:
        logger.warning("tokenizer cache not written (%s)", exc)
        return
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, folder)
    except OSError as exc:
        if not os.path.isdir(folder):
            logger.warning("tokenizer cache not written (%s)", exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def get_tokenizer(info: ModelInfo):
    """The model's tokenizer; ``model.tokenizer`` overrides where it comes from."""
    if info.tokenizer_path:
        return _load(info.tokenizer_path, None)
    if info.format == "gguf":
        return _load(os.path.dirname(info.path), os.path.basename(info.path))
    return _load(info.path, None)
