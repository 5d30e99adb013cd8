"""The sparse mixture-of-experts block the MoE families share (router, routed experts, optional shared expert),
and the checkpoint-name mapping of their experts."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.interfaces.layer_kernels import MoERouting
from engine.model.layers.linear import ReplicatedLinear
from engine.model.layers.moe import FusedMoE
from engine.model.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """``gate`` (the router: one logit per expert), ``experts`` (:class:`FusedMoE`) and, where the family has one,
    a ``shared_expert`` every token passes through (Qwen2-MoE gates it with a sigmoid of ``shared_expert_gate``;
    DeepSeek adds it as it is)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        moe_intermediate_size: int,
        routing: MoERouting,
        layer_index: int,
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        router_dtype: Optional[torch.dtype] = None,
        has_correction_bias: bool = False,
    ):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, params_dtype=router_dtype)
        self.experts = FusedMoE(
            num_experts, hidden_size, moe_intermediate_size, routing, layer_index, has_correction_bias
        )
        self.shared_expert = LlamaMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert_gate else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden_states).to(shared.dtype)) * shared
            out = out + shared
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-shaped causal LM whose layers may hold a :class:`SparseMoeBlock`: expert tensors load into the
    stacked expert weights (per-expert names, ``expert_names`` = the gate, down and up projections' names, or the
    stacked ``experts.gate_up_proj`` layout); ``renamed_modules`` maps checkpoint module names to this model's."""

    expert_names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")
    renamed_modules: dict[str, str] = {}

    def __init__(self, config):
        super().__init__(config)
        self.expert_params_mapping = FusedMoE.make_expert_params_mapping(self.num_experts(config), *self.expert_names)

    @staticmethod
    def num_experts(config) -> int:
        return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)

    def checkpoint_target(self, name: str) -> tuple[str, tuple]:
        for old, new in self.renamed_modules.items():
            name = name.replace(old, new)
        if "experts." in name:
            for param_piece, ckpt_piece, expert_id, shard_id in self.expert_params_mapping:
                if ckpt_piece in name:
                    return name.replace(ckpt_piece, param_piece), (shard_id, expert_id)
        return super().checkpoint_target(name)
