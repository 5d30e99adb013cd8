"""Where the engine keeps what it computes once per machine: ``$XDG_CACHE_HOME/engine/<kind>/`` (``~/.cache`` when
the variable is unset). Kinds: ``products`` (the linear products chosen by measurement), ``tokenizers`` (GGUF
files' tokenizers, converted once)."""

from __future__ import annotations

import os


def engine_cache_dir(kind: str) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "engine", kind)
