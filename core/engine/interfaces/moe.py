"""The mixture-of-experts part of the layer-kernels contract: how a router's logits pick experts
(:class:`MoERouting`) and the experts' weights as the kernels see them (:class:`ExpertWeights`). Its own module,
importing nothing of the engine, so the torch reference and the layers can name these types without a circle
through ``layer_kernels``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Protocol

import torch


@dataclass(frozen=True)
class MoERouting:
    """How a router's logits choose each token's experts and weigh them (vLLM's ``FusedMoE`` routing arguments).

    ``softmax`` (Mixtral, Qwen-MoE, DeepSeek-V2) or ``sigmoid`` (DeepSeek-V3) scores; with ``num_expert_group``,
    only the ``topk_group`` best groups of experts compete (a group scores its best expert, ``group_score="max"``,
    as DeepSeek-V2, or the sum of its two best, ``"top2_sum"``, as V3); a correction bias (V3's
    ``e_score_correction_bias``) moves the choice but not the weights; ``renormalize`` makes each token's weights
    sum to one; all are multiplied by ``routed_scaling_factor``.
    """

    top_k: int
    renormalize: bool = False
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    group_score: Literal["max", "top2_sum"] = "max"
    routed_scaling_factor: float = 1.0


ExpertsProduct = Callable[..., torch.Tensor]


class ExpertWeights(Protocol):
    """The routed experts of one MoE layer as the kernels see them (``engine.model.layers.moe.FusedMoE``)."""

    @property
    def w13_weight(self) -> torch.Tensor:
        """``[local experts, 2 x intermediate, hidden]``: each expert's gate rows, then its up rows."""

    @property
    def w2_weight(self) -> torch.Tensor:
        """``[local experts, hidden, intermediate]``: each expert's down projection."""

    @property
    def expert_map(self) -> Optional[torch.Tensor]:
        """Global expert id -> index in the weights above, -1 for an expert another rank holds (expert
        parallelism); None: every expert is here."""

    @property
    def packed(self) -> Optional[ExpertsProduct]:
        """What ``pack_experts`` prepared, or None."""
