"""Per-step state the attention layers read during a forward pass (set by the model runner)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ForwardContext:
    attn_metadata: list[Any]  # one backend metadata object per KV-cache group
    common: Optional[Any] = None  # the step's CommonAttentionMetadata (encoder-only layers attend from it)


_CURRENT: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside a model-runner step (no forward context set)")
    return _CURRENT


@contextlib.contextmanager
def set_forward_context(attn_metadata: list[Any], common: Optional[Any] = None):
    global _CURRENT
    previous, _CURRENT = _CURRENT, ForwardContext(attn_metadata, common)
    try:
        yield
    finally:
        _CURRENT = previous
