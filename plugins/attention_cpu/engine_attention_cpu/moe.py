"""The ``cpu`` layer kernels' fused mixture-of-experts operation: every expert's gate/up and down weights packed once
into the GEMM's 16-column panels, and one C++ call per MoE layer and step (``csrc/fused_moe.cpp``) that groups the
tokens by expert and runs each expert's rows as one product."""

from __future__ import annotations

from typing import Optional

import torch

from engine_attention_cpu.gemm import PANEL


class CpuFusedExperts:
    """``(x, topk_weights, topk_ids, expert_map) -> [T, hidden]`` on packed experts, computed in float32 (so a
    bfloat16 model's experts get float32 accumulation) and returned in x's dtype."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        from engine_attention_cpu import _gemm, _moe

        self._moe = _moe
        self.num_experts, self.hidden_size, self.intermediate_size = w2.shape
        self.w13 = torch.stack([_gemm.pack_weight(w.detach().float()) for w in w13])
        self.w2 = torch.stack([_gemm.pack_weight(w.detach().float()) for w in w2])
        assert self.w13.shape[-1] == PANEL

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._moe.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, expert_map, self.intermediate_size)
