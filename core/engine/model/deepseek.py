"""DeepSeek-V2 / V3's mixture-of-experts part: routed experts beside always-on shared experts, dense layers before
``first_k_dense_replace``; V2 routes by softmax (greedy, or limited to the best ``topk_group`` groups), V3 by sigmoid
scores with ``e_score_correction_bias`` steering the choice within the best groups; both scale the weights by
``routed_scaling_factor``. The router computes in float32, as DeepSeek's reference does."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces.layer_kernels import MoERouting
from engine.model.llama import LlamaMLP
from engine.model.sparse_moe import SparseMoeBlock

# checkpoint module names -> this engine's (the MoE block's shared expert and the experts' correction bias)
DEEPSEEK_RENAMED_MODULES = {
    ".mlp.shared_experts.": ".mlp.shared_expert.",
    ".mlp.gate.e_score_correction_bias": ".mlp.experts.e_score_correction_bias",
}


def deepseek_routing(config) -> MoERouting:
    """The routing a DeepSeek-V2 (``topk_method`` greedy / group_limited_greedy) or V3 (noaux_tc) config describes."""
    method = getattr(config, "topk_method", None) or "noaux_tc"
    sigmoid = method == "noaux_tc" or getattr(config, "scoring_func", "softmax") == "sigmoid"
    grouped = method in ("group_limited_greedy", "noaux_tc") and (getattr(config, "n_group", None) or 1) > 1
    return MoERouting(
        top_k=config.num_experts_per_tok,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        group_score="top2_sum" if method == "noaux_tc" else "max",
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )


def is_deepseek_moe_layer(config, layer_index: int) -> bool:
    """Layers from ``first_k_dense_replace`` on hold experts (every ``moe_layer_freq``-th, where a config sets it)."""
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return bool(config.n_routed_experts) and layer_index >= config.first_k_dense_replace and layer_index % freq == 0


def deepseek_mlp(config, layer_index: int) -> nn.Module:
    """A DeepSeek layer's feed-forward block: the MoE block, or the dense MLP of the first layers."""
    if not is_deepseek_moe_layer(config, layer_index):
        return LlamaMLP(config.hidden_size, config.intermediate_size)
    routing = deepseek_routing(config)
    return SparseMoeBlock(
        config.hidden_size,
        config.n_routed_experts,
        config.moe_intermediate_size,
        routing,
        layer_index,
        shared_intermediate_size=config.moe_intermediate_size * (getattr(config, "n_shared_experts", 0) or 0),
        router_dtype=torch.float32,
        has_correction_bias=routing.scoring_func == "sigmoid",
    )
