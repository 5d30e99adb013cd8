"""Rotary position embeddings (GPT-NeoX layout) with default, linear and llama3 frequency scaling."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_settings(hf_config) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, scaling dict or None) from either transformers 4 or 5 style configs."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(theta), scaling
    theta = getattr(hf_config, "rope_theta", 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to flattened q [T, H*D] and k [T, Hkv*D] at given positions."""

    def __init__(self, head_size: int, max_position: int, base: float, scaling: Optional[dict[str, Any]] = None,
                 rotary_dim: Optional[int] = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        # float32 throughout, as the reference implementation computes it, so that positions agree bit for bit
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim))
        positions = torch.arange(max_position, dtype=torch.float32)
        rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            positions = positions / scaling["factor"]
        elif rope_type is not None:
            raise ValueError(f"rope scaling type '{rope_type}' is not supported (default, linear, llama3)")
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos_cache", freqs.cos().float(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().float(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        x = x.view(tokens, -1, self.head_size)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(tokens, -1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
