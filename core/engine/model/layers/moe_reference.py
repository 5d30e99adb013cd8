"""The torch reference of the fused mixture-of-experts operation: expert selection and the grouped expert
products that every ``LayerKernels`` implementation is checked against (``native`` runs these)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.interfaces.moe import MoERouting


def select_experts(
    router_logits: torch.Tensor, routing: MoERouting, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32, ids int64)``, each ``[T, top_k]``, as ``MoERouting`` describes (scores in float32, as
    the reference implementations compute them)."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if routing.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    groups = routing.num_expert_group
    if groups and groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, groups, experts // groups)
        if routing.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(int(routing.topk_group or groups), dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts), float("-inf"))
    ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        denominator = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denominator + 1e-20 if routing.scoring_func == "sigmoid" else denominator)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


def local_expert_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Each choice's index among this rank's experts (-1 where another rank holds the expert)."""
    return topk_ids if expert_map is None else expert_map[topk_ids]


def group_by_expert(local_ids: torch.Tensor, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, choice) pairs sorted by local expert (stable: tokens in order within an expert): ``(flat choice
    index, token index, count per local expert)``; choices of other ranks' experts are left out."""
    top_k = local_ids.shape[1]
    flat = local_ids.flatten()
    flat = torch.where(flat < 0, num_local_experts, flat)  # other ranks' experts sort last and are dropped
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_local_experts + 1)[:num_local_experts].tolist()
    order = order[: sum(counts)]
    return order, order // top_k, counts


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x))`` per token over its experts held here, the products in
    the weights' dtype, the weighted sum in float32 in the order of the experts' ids; returns x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order, tokens, counts = group_by_expert(local_expert_ids(topk_ids, expert_map), w13.shape[0])
    rows = x.to(w13.dtype).index_select(0, tokens)
    weights = topk_weights.flatten().float().index_select(0, order)
    start = 0
    for expert, count in enumerate(counts):  # the reference: one product pair per expert with tokens
        if count == 0:
            continue
        end = start + count
        gate, up = F.linear(rows[start:end], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]).float() * weights[start:end, None]
        out.index_add_(0, tokens[start:end], y)
        start = end
    return out.to(x.dtype)
