"""Qwen2-MoE (a sigmoid-gated shared expert beside the routed ones, q/k/v biases) and Qwen3-MoE (q/k norms, no
shared expert); both choose sparse layers by ``mlp_only_layers`` and ``decoder_sparse_step``."""

from __future__ import annotations

from torch import nn

from engine.interfaces.layer_kernels import MoERouting
from engine.model.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from engine.model.qwen import Qwen2Attention, Qwen3Attention
from engine.model.sparse_moe import MoEForCausalLM, SparseMoeBlock


def is_sparse_layer(config, layer_index: int) -> bool:
    """Qwen-MoE's rule: a layer is sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_index + 1) % step == 0
    )


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return LlamaMLP(config.hidden_size, config.intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            MoERouting(top_k=config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False))),
            layer_index,
            shared_intermediate_size=shared,
            shared_expert_gate=bool(shared),
        )


class Qwen2MoeModel(LlamaModel):
    decoder_layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    model_cls = Qwen2MoeModel
    attention_cls = Qwen2Attention


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms), no shared expert."""

    model_cls = Qwen2MoeModel
    attention_cls = Qwen3Attention
