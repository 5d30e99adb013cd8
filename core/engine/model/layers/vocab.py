"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group
from engine.model.layers.linear import set_quantized_weight
from engine.model.quant_formats import QuantizedWeight, cat_rows, dequantize


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by rank; out-of-slice tokens contribute zeros, then an all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.data[self.vocab_end - self.vocab_start :].zero_()  # the last rank's padding rows
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read by weight_loader_of
        self.quant_weight: QuantizedWeight | None = None  # a packed table (GGUF), looked up row by row

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = self.vocab_end - self.vocab_start
        if isinstance(loaded, QuantizedWeight):
            table = loaded.narrow(0, self.vocab_start, rows)
            if rows < self.vocab_per_rank:  # padding rows of zero blocks (zero scales)
                pad = QuantizedWeight(
                    table.format,
                    (self.vocab_per_rank - rows, table.shape[1]),
                    torch.zeros(self.vocab_per_rank - rows, table.data.shape[1], dtype=table.data.dtype),
                    None if table.scales is None else torch.zeros(self.vocab_per_rank - rows),
                )
                table = cat_rows([table, pad])
            set_quantized_weight(self, table)
            return
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1)
        rows = dequantize(self.quant_weight.index_rows(flat)).to(self.weight.dtype)
        return rows.view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        in_slice = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_slice, input_ids - self.vocab_start, 0)
        out = self._lookup(local) * in_slice.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: this rank's vocabulary slice (the model computes and gathers the logits)."""
