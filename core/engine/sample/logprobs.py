"""Logprobs of sampled (or prompt) tokens, their ranks and the top-k, from raw logits."""

from __future__ import annotations

import torch

from engine.messages import TokenLogprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs [N, V] (log-softmaxed), token_ids [N]; row i keeps its ``num_top[i]`` best tokens."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], token_ids[:, None][:, :0])
    ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1).tolist()
    values = torch.cat([chosen, top_values], dim=1).tolist()
    return [
        TokenLogprobs(ids[i][: 1 + n], values[i][: 1 + n], int(r))
        for i, (n, r) in enumerate(zip(num_top, ranks.tolist()))
    ]
