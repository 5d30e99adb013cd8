"""The torch reference of the fused mixture-of-experts operation: expert selection and the grouped expert
products that every ``LayerKernels`` implementation is checked against (``native`` runs these)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from engine.model.quant_formats import QuantizedExperts, dequantize, quantize_activations

if TYPE_CHECKING:
    from engine.interfaces.moe import ExpertsProduct, MoERouting


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
    return _grouped_experts(
        x,
        x.to(w13.dtype),
        w13.shape[0],
        lambda expert, rows: F.linear(rows, w13[expert]),
        lambda expert, rows: F.linear(rows, w2[expert]),
        topk_weights,
        topk_ids,
        expert_map,
    )


def quantized_fused_experts(
    x: torch.Tensor,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The fused-MoE operation on packed quantized experts as integer-dot kernels compute it: each product's
    activations rounded per block of 32 (``quantize_activations``), then multiplied by the de-quantized weight, in
    float32. The reference a kernel on packed experts is checked against."""

    def product(weights: QuantizedExperts) -> Callable[[int, torch.Tensor], torch.Tensor]:
        return lambda expert, rows: F.linear(quantize_activations(rows), dequantize(weights.expert(expert)))

    return _grouped_experts(x, x.float(), w13.shape[0], product(w13), product(w2), topk_weights, topk_ids, expert_map)


def dequantize_experts(weights: QuantizedExperts) -> torch.Tensor:
    """Packed experts de-quantized: float32 ``[experts, out_features, in_features]``."""
    return torch.stack([dequantize(weights.expert(e)) for e in range(weights.shape[0])])


def dequantized_experts_product(w13: torch.Tensor, w2: torch.Tensor) -> ExpertsProduct:
    """The reference ``fused_experts`` on fixed expert weights, as an experts' product."""

    def product(x, topk_weights, topk_ids, expert_map=None):
        return fused_experts(x, w13, w2, topk_weights, topk_ids, expert_map)

    return product


def _grouped_experts(
    x: torch.Tensor,
    x_cast: torch.Tensor,
    num_experts: int,
    gate_up: Callable[[int, torch.Tensor], torch.Tensor],
    down: Callable[[int, torch.Tensor], torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order, tokens, counts = group_by_expert(local_expert_ids(topk_ids, expert_map), num_experts)
    rows = x_cast.index_select(0, tokens)
    weights = topk_weights.flatten().float().index_select(0, order)
    start = 0
    for expert, count in enumerate(counts):  # the reference: one product pair per expert with tokens
        if count == 0:
            continue
        end = start + count
        gate, up = gate_up(expert, rows[start:end]).chunk(2, dim=-1)
        y = down(expert, F.silu(gate) * up).float() * weights[start:end, None]
        out.index_add_(0, tokens[start:end], y)
        start = end
    return out.to(x.dtype)
