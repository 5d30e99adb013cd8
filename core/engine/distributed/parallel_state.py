"""GroupCoordinator: the tensor-parallel group of this process; collectives are no-ops for one rank."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class GroupCoordinator:
    """Rank, size and collectives of one process group."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Optional[dist.ProcessGroup] = None):
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank ends with ``src``'s tensor (in place)."""
        if self.world_size == 1:
            return tensor
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor



_TP_GROUP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> GroupCoordinator:
    """Join the tensor-parallel group (one process per rank)."""
    global _TP_GROUP
    if world_size > 1:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
        _TP_GROUP = GroupCoordinator(rank, world_size, dist.group.WORLD)
    else:
        _TP_GROUP = GroupCoordinator()
    return _TP_GROUP


def destroy_tensor_parallel() -> None:
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = GroupCoordinator()
