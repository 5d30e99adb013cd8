"""Qwen2 / Qwen2.5 (bias on q, k and v) and Qwen3 (per-head RMSNorm on q and k) over the Llama layers."""

from __future__ import annotations

from engine.model.layers.norm import RMSNorm
from engine.model.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    def projection_biases(self, config) -> tuple[bool, bool]:
        return True, False  # Qwen2 checkpoints carry q/k/v biases and an unbiased o_proj


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 and Qwen2.5; sliding-window layers follow ``use_sliding_window`` / ``max_window_layers``."""

    attention_cls = Qwen2Attention


class Qwen3Attention(LlamaAttention):
    qk_norm_cls = RMSNorm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
