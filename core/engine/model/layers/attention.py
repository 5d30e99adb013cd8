"""The attention layers: a model's handle on the chosen backend's implementation and its KV cache (per-head K/V, or
MLA's latent rows)."""

from __future__ import annotations

from typing import Any, Callable, Optional

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
        attn_type: str = "decoder",
    ):
        """``attn_type``: ``decoder`` (causal, over the paged KV cache) or ``encoder_only`` (bidirectional within
        each request's step, no cache: BERT-like pooling models)."""
        super().__init__()
        self.layer_name = layer_name
        self.attn_type = attn_type
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
        context = get_forward_context()
        if self.attn_type == "encoder_only":
            return self.impl.forward_encoder_only(query, key, value, context.common)
        return self.impl.forward(query, key, value, self.kv_cache, context.attn_metadata[self.kv_cache_group])


class MLAAttention(nn.Module):
    """Per-layer multi-head latent attention: the backend's MLA implementation over a latent cache (one row of
    ``kv_lora_rank + qk_rope_head_dim`` per token). ``kv_b_weight`` returns this rank's ``kv_b_proj`` weight (read at
    bind time, once the weights are loaded)."""

    num_kv_heads = 1
    sliding_window = None
    logits_soft_cap = None

    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_b_weight: Callable[[], torch.Tensor],
    ):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.head_size = kv_lora_rank + qk_rope_head_dim  # the cache row
        self.kv_b_weight = kv_b_weight
        self.impl: Any = None
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_cache_group = 0

    def bind(self, backend, options: dict) -> None:
        """Create this layer's implementation of the selected backend's MLA kind."""
        impl_cls = backend.get_mla_impl_cls()
        if impl_cls is None:
            raise ValueError(
                f"attention backend '{backend.name}' cannot serve MLA (multi-head latent attention): "
                f"{backend.mla_unsupported_reason}"
            )
        self.impl = impl_cls(
            self.num_heads,
            self.scale,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_b_weight().detach(),
            options,
        )

    def forward(self, query: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """query [T, H, nope + rope], kv_c_normed [T, kv_lora_rank], k_pe [T, rope] -> [T, H * v_head_dim]."""
        metadata = get_forward_context().attn_metadata[self.kv_cache_group]
        return self.impl.forward(query, kv_c_normed, k_pe, self.kv_cache, metadata)
