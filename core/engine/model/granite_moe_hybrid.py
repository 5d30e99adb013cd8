"""Granite 4.0-H (GraniteMoeHybridForCausalLM): Bamba's Mamba2 mixers and attention layers (rotary or none), each
followed by a softmax top-k MoE block plus a shared MLP, with Granite's multipliers on the embeddings, the attention
scores, each residual branch and the logits."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.interfaces.layer_kernels import MoERouting
from engine.model.bamba import BambaAttention, BambaDecoderLayer
from engine.model.llama import LlamaMLP, LlamaModel
from engine.model.sparse_moe import MoEForCausalLM, SparseMoeBlock


class GraniteMoeHybridAttention(BambaAttention):
    """Scores scaled by ``attention_multiplier``; rotary embeddings only with ``position_embedding_type="rope"``."""

    def __init__(self, config, layer_index: int, prefix: str):
        super().__init__(config, layer_index, prefix)
        self.use_rope = getattr(config, "position_embedding_type", None) == "rope"

    def attention_scale(self, config) -> float:
        return float(config.attention_multiplier)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.use_rope:
            return super().forward(positions, hidden_states)
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class GraniteMoeHybridMoE(nn.Module):
    """The routed experts (when the model has any) plus the shared MLP every token passes through."""

    def __init__(self, config, layer_index: int):
        super().__init__()
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        routing = MoERouting(top_k=config.num_experts_per_tok, renormalize=True)
        self.moe = (
            SparseMoeBlock(config.hidden_size, experts, config.intermediate_size, routing, layer_index)
            if experts
            else None
        )
        self.shared_mlp = LlamaMLP(config.hidden_size, config.shared_intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_mlp(hidden_states)
        return shared if self.moe is None else self.moe(hidden_states) + shared


class GraniteMoeHybridDecoderLayer(BambaDecoderLayer):
    """Bamba's layer with each branch scaled by ``residual_multiplier`` before it joins the residual stream."""

    def __init__(self, config, layer_index: int, prefix: str, attention_cls: type = GraniteMoeHybridAttention):
        super().__init__(config, layer_index, prefix, attention_cls)
        self.residual_multiplier = float(config.residual_multiplier)

    def make_mlp(self, config, layer_index: int) -> nn.Module:
        return GraniteMoeHybridMoE(config, layer_index)

    def scale_branch(self, branch: torch.Tensor) -> torch.Tensor:
        return branch * self.residual_multiplier


class GraniteMoeHybridModel(LlamaModel):
    decoder_layer_cls = GraniteMoeHybridDecoderLayer

    def __init__(self, config, attention_cls: type = GraniteMoeHybridAttention, prefix: str = "model"):
        super().__init__(config, attention_cls, prefix)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier


class GraniteMoeHybridForCausalLM(MoEForCausalLM):
    """Granite's checkpoint names: ``block_sparse_moe`` (router ``router.layer``, experts stacked as ``input_linear``
    [experts, 2 x intermediate, hidden] and ``output_linear``), ``shared_mlp`` (gate and up fused in
    ``input_linear``), ``post_attention_layernorm`` before the MLPs; logits divided by ``logits_scaling``."""

    model_cls = GraniteMoeHybridModel
    attention_cls = GraniteMoeHybridAttention
    renamed_modules = {
        ".block_sparse_moe.router.layer.": ".feed_forward.moe.gate.",
        ".block_sparse_moe.input_linear.weight": ".feed_forward.moe.experts.gate_up_proj",
        ".block_sparse_moe.output_linear.weight": ".feed_forward.moe.experts.down_proj",
        ".shared_mlp.output_linear.": ".feed_forward.shared_mlp.down_proj.",
        ".post_attention_layernorm.": ".pre_ff_layernorm.",
    }

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / float(self.config.logits_scaling)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_shared_input(weights))

    @staticmethod
    def _split_shared_input(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The shared MLP's fused ``input_linear`` [2 x intermediate, hidden] as its gate and up projections."""
        for name, tensor in weights:
            if name.endswith(".shared_mlp.input_linear.weight"):
                gate, up = tensor.chunk(2, dim=0)
                prefix = name[: -len("input_linear.weight")].replace(".shared_mlp.", ".feed_forward.shared_mlp.")
                yield prefix + "gate_proj.weight", gate
                yield prefix + "up_proj.weight", up
            else:
                yield name, tensor
