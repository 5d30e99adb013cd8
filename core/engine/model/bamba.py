"""Bamba (IBM's Mamba2 hybrid): Mamba2 mixers with a few attention layers (``attn_layer_indices``, rotary on the
first half of each head), each followed by a SiLU-gated MLP."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.model.layers.mamba2 import MambaMixer2
from engine.model.layers.mamba_state import MambaLayer
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding, rope_settings
from engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


def partial_rotary_factor(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))


class BambaAttention(LlamaAttention):
    """Llama's attention with rotary embeddings on the first ``partial_rotary_factor`` of each head."""

    def __init__(self, config, layer_index: int, prefix: str):
        super().__init__(config, layer_index, prefix)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(
            self.head_size,
            config.max_position_embeddings,
            theta,
            scaling,
            rotary_dim=int(self.head_size * partial_rotary_factor(config)),
        )


class BambaDecoderLayer(nn.Module):
    """A Mamba2 mixer or an attention layer, then the MLP (``layers_block_type`` says which)."""

    def __init__(self, config, layer_index: int, prefix: str, attention_cls: type = BambaAttention):
        super().__init__()
        self.is_attention = config.layers_block_type[layer_index] in ("attention", "full_attention")
        if self.is_attention:
            self.self_attn = attention_cls(config, layer_index, f"{prefix}.self_attn")
        else:
            self.mamba = self.make_mixer(config, prefix)
        self.feed_forward = self.make_mlp(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mixer(self, config, prefix: str) -> MambaLayer:
        return MambaMixer2(
            f"{prefix}.mamba",
            config.hidden_size,
            config.mamba_n_heads,
            config.mamba_d_head,
            config.mamba_n_groups,
            config.mamba_d_state,
            config.mamba_d_conv,
            config.mamba_chunk_size,
            config.rms_norm_eps,
            torch.get_default_dtype(),
            use_conv_bias=config.mamba_conv_bias,
            use_bias=config.mamba_proj_bias,
            time_step_limit=getattr(config, "time_step_limit", None),
        )

    def make_mlp(self, config, layer_index: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer: (this layer's MLP output, the residual before it)."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        mixed = self.self_attn(positions, hidden_states) if self.is_attention else self.mamba(hidden_states)
        hidden_states, residual = self.pre_ff_layernorm(self.scale_branch(mixed), residual)
        return self.scale_branch(self.feed_forward(hidden_states)), residual

    def scale_branch(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output as it joins the residual stream (Granite scales it)."""
        return branch


class BambaModel(LlamaModel):
    decoder_layer_cls = BambaDecoderLayer


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba: Hugging Face names, with ``final_layernorm`` for the final norm."""

    model_cls = BambaModel
    attention_cls = BambaAttention

    def checkpoint_target(self, name: str) -> tuple[str, tuple]:
        return super().checkpoint_target(name.replace("model.final_layernorm.", "model.norm."))
