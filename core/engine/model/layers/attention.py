"""The Attention layer: a model's handle on the chosen backend's implementation and its KV cache."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from engine.forward_context import get_forward_context


class Attention(nn.Module):
    """Per-layer attention; the model runner binds the backend impl, KV-cache tensor and group."""

    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.impl: Any = None  # the backend's AttentionImpl, made by bind()
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_cache_group = 0

    def bind(self, backend, options: dict) -> None:
        """Create this layer's implementation of the selected attention backend."""
        self.impl = backend.get_impl_cls()(
            self.num_heads,
            self.head_size,
            self.scale,
            self.num_kv_heads,
            self.sliding_window,
            self.logits_soft_cap,
            options,
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata[self.kv_cache_group]
        return self.impl.forward(query, key, value, self.kv_cache, metadata)
