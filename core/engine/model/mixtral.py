"""Mixtral: Mistral's attention with a sparse MoE block in every layer (softmax top-k, renormalised)."""

from __future__ import annotations

from torch import nn

from engine.interfaces.layer_kernels import MoERouting
from engine.model.llama import LlamaDecoderLayer, LlamaModel
from engine.model.sparse_moe import MoEForCausalLM, SparseMoeBlock


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_index: int) -> nn.Module:
        routing = MoERouting(top_k=config.num_experts_per_tok, renormalize=True)
        return SparseMoeBlock(
            config.hidden_size, config.num_local_experts, config.intermediate_size, routing, layer_index
        )


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoEForCausalLM):
    """``block_sparse_moe`` in the checkpoint is this model's ``mlp``; its experts' w1/w3/w2 are gate/up/down."""

    model_cls = MixtralModel
    expert_names = ("w1", "w2", "w3")
    renamed_modules = {".block_sparse_moe.": ".mlp."}
