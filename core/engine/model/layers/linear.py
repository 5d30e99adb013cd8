"""Linear layers sharded by tensor-parallel rank: column (incl. merged and QKV) and row parallel."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group


def _param(shape: Sequence[int], loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class ColumnParallelLinear(nn.Module):
    """y = xW^T + b with W split along its output rows; each rank keeps its slice of y."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            if size % self.tp_size:
                raise ValueError(f"output size {size} is not divisible by tensor_parallel_size {self.tp_size}")
        self.output_size_per_partition = sum(self.output_sizes) // self.tp_size
        self.weight = _param((self.output_size_per_partition, input_size), self.weight_loader)
        self.bias = _param((self.output_size_per_partition,), self.weight_loader) if bias else None

    def shard_bounds(self, shard_id) -> tuple[int, int, int]:
        """(offset in this rank's param, size, offset in the full checkpoint tensor) of a shard."""
        index = 0 if shard_id is None else shard_id
        offset = sum(self.output_sizes[:index]) // self.tp_size
        size = self.output_sizes[index] // self.tp_size
        return offset, size, self.tp_rank * size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None and len(self.output_sizes) > 1:
            raise ValueError("a merged layer needs the shard id of each checkpoint tensor")
        offset, size, src_offset = self.shard_bounds(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, src_offset, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; KV heads are replicated when ranks outnumber them."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_group().world_size
        if total_num_heads % tp_size:
            raise ValueError(f"{total_num_heads} attention heads are not divisible by tensor_parallel_size {tp_size}")
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        self.head_size = head_size
        q_size, kv_size = total_num_heads * head_size, self.num_kv_heads * tp_size * head_size
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)

    def shard_bounds(self, shard_id) -> tuple[int, int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        offset, size, src_offset = super().shard_bounds(index)
        if index > 0:  # replicated KV heads: ranks sharing a head read the same slice
            src_offset = (self.tp_rank // self.kv_replicas) * size
        return offset, size, src_offset


class RowParallelLinear(nn.Module):
    """y = xW^T + b with W split along its input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        if input_size % tp.world_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor_parallel_size {tp.world_size}")
        self.input_size_per_partition = input_size // tp.world_size
        self.weight = _param((output_size, self.input_size_per_partition), self.weight_loader)
        self.bias = _param((output_size,), self._bias_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = self.input_size_per_partition
        param.data.copy_(loaded.narrow(1, self.tp.rank * size, size))

    @staticmethod
    def _bias_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def weight_loader_of(param: nn.Parameter):
    return getattr(param, "weight_loader", default_weight_loader)


def maybe_bias(module: Optional[nn.Module]) -> Optional[torch.Tensor]:
    return None if module is None else getattr(module, "bias", None)
