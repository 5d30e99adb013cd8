"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by rank; out-of-slice tokens contribute zeros, then an all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_slice = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_slice, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_slice.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: this rank's vocabulary slice (the model computes and gathers the logits)."""
