"""Jamba (AI21): Mamba1 mixers with an attention layer every ``attn_layer_period`` layers (no positional
embedding), and a softmax top-k MoE block (weights not renormalised) every ``expert_layer_period`` layers, a dense
MLP elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces.layer_kernels import MoERouting
from engine.model.bamba import BambaDecoderLayer
from engine.model.granite_moe_hybrid import GraniteMoeHybridAttention
from engine.model.layers.mamba1 import MambaMixer
from engine.model.llama import LlamaMLP, LlamaModel
from engine.model.sparse_moe import MoEForCausalLM, SparseMoeBlock


class JambaAttention(GraniteMoeHybridAttention):
    """Attention without rotary embeddings, scores scaled by ``head_dim ** -0.5``."""

    def attention_scale(self, config) -> float:
        return self.head_size**-0.5


class JambaDecoderLayer(BambaDecoderLayer):
    def make_mixer(self, config, prefix: str) -> MambaMixer:
        rank = config.mamba_dt_rank
        return MambaMixer(
            f"{prefix}.mamba",
            config.hidden_size,
            config.mamba_expand * config.hidden_size,
            config.mamba_d_state,
            config.mamba_d_conv,
            rank if isinstance(rank, int) else -(-config.hidden_size // 16),
            config.rms_norm_eps,
            torch.get_default_dtype(),
            use_conv_bias=config.mamba_conv_bias,
            use_bias=config.mamba_proj_bias,
        )

    def make_mlp(self, config, layer_index: int) -> nn.Module:
        experts = config.layers_num_experts[layer_index]
        if experts <= 1:
            return LlamaMLP(config.hidden_size, config.intermediate_size)
        routing = MoERouting(top_k=config.num_experts_per_tok, renormalize=False)
        return SparseMoeBlock(config.hidden_size, experts, config.intermediate_size, routing, layer_index)


class JambaModel(LlamaModel):
    decoder_layer_cls = JambaDecoderLayer


class JambaForCausalLM(MoEForCausalLM):
    """Jamba's checkpoint names: ``final_layernorm``, the router as ``feed_forward.router``."""

    model_cls = JambaModel
    attention_cls = JambaAttention
    renamed_modules = {".feed_forward.router.": ".feed_forward.gate.", "model.final_layernorm.": "model.norm."}
