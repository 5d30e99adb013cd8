"""Rotary position embeddings (GPT-NeoX layout) with default, linear, llama3 and YaRN frequency scaling."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from engine.model.layers.kernels import current_layer_kernels


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V2/V3's long-context scaling): interpolated low frequencies, extrapolated high ones, blended
    over the correction range; and the factor cos / sin are scaled by."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else yarn_mscale(factor)
        )
    return inv_freq, float(attention_factor)


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


class _RopeTable:
    """cos / sin of every position for one RoPE setting, shared by all layers that use it."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        # rotate_half convention: x * [cos, cos] + [-x2, x1] * [sin, sin] = x * cos_full + swap(x) * sin_full
        self.cos = torch.cat((cos, cos), dim=-1)
        self.sin = torch.cat((-sin, sin), dim=-1)


_TABLES: dict[tuple, _RopeTable] = {}


def _rope_table(rotary_dim: int, max_position: int, base: float, scaling: Optional[dict[str, Any]]) -> _RopeTable:
    device = torch.empty(0).device  # models are built under ``with torch.device(...)``
    key = (rotary_dim, max_position, base, repr(sorted((scaling or {}).items())), str(device))
    if key not in _TABLES:
        # float32 throughout, as the reference implementation computes it, so that positions agree bit for bit
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        positions = torch.arange(max_position, dtype=torch.float32)
        rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        magnitude = 1.0
        if rope_type == "yarn" and scaling:
            inv_freq, magnitude = _yarn_inv_freq(rotary_dim, base, scaling)
        elif rope_type == "llama3" and scaling:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear" and scaling:
            positions = positions / scaling["factor"]
        elif rope_type is not None:
            raise ValueError(f"rope scaling type '{rope_type}' is not supported (default, linear, llama3, yarn)")
        freqs = torch.outer(positions, inv_freq)
        _TABLES[key] = _RopeTable(freqs.cos().float() * magnitude, freqs.sin().float() * magnitude)
    return _TABLES[key]


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to flattened q [T, H*D] and k [T, Hkv*D] at given positions."""

    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float,
        scaling: Optional[dict[str, Any]] = None,
        rotary_dim: Optional[int] = None,
    ):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        self.table = _rope_table(self.rotary_dim, max_position, base, scaling)
        self.kernels = current_layer_kernels()

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return self.kernels.rotary_embedding(positions, query, key, self.table.cos, self.table.sin, self.head_size)
