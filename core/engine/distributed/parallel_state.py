"""Process groups of one worker: its tensor-parallel group (the ranks of its pipeline stage) and its
pipeline-parallel group (its peers at the same TP rank in every stage), and the expert-parallel group over
which MoE layers place whole experts (the TP group with ``enable_expert_parallel``, else a group of one).

Ranks are laid out as vLLM lays them out: global rank = pp_rank x TP + tp_rank, so the TP ranks of a stage
are neighbours and the last stage's first rank (world - TP) is the one whose step output is the engine's.
Every collective is a no-op in a group of one rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class GroupCoordinator:
    """Rank, size and collectives of one process group; ``ranks`` are the members' global ranks."""

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        group: Optional[dist.ProcessGroup] = None,
        ranks: Optional[list[int]] = None,
    ):
        self.rank = rank  # rank within this group
        self.world_size = world_size
        self.group = group
        self.ranks = ranks if ranks is not None else list(range(world_size))

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

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
        """Every rank ends with group rank ``src``'s tensor (in place)."""
        if self.world_size == 1:
            return tensor
        dist.broadcast(tensor, src=self.ranks[src], group=self.group)
        return tensor

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Send named tensors to the next rank of this group (shapes are known to the receiver)."""
        dst = self.ranks[self.rank + 1]
        for name in sorted(tensors):
            dist.send(tensors[name].contiguous(), dst=dst, group=self.group)

    def recv_tensor_dict(self, empty: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fill ``empty`` (tensors of the expected shapes) from the previous rank of this group."""
        src = self.ranks[self.rank - 1]
        for name in sorted(empty):
            dist.recv(empty[name], src=src, group=self.group)
        return empty


_TP_GROUP = GroupCoordinator()
_PP_GROUP = GroupCoordinator()
_EP_GROUP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


def get_pp_group() -> GroupCoordinator:
    return _PP_GROUP


def get_ep_group() -> GroupCoordinator:
    """The ranks over which MoE layers spread whole experts (vLLM's ``--enable-expert-parallel``): the TP group
    when it is on, else this rank alone (each TP rank then holds a slice of every expert)."""
    return _EP_GROUP


def init_model_parallel(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    init_method: str,
    backend: str,
    enable_expert_parallel: bool = False,
) -> tuple[GroupCoordinator, GroupCoordinator]:
    """Join the world of TP x PP workers and this rank's TP and PP groups (one process per rank); with
    ``enable_expert_parallel`` the TP group is also the expert-parallel group."""
    global _EP_GROUP
    tp_group, pp_group = _init_tp_pp(rank, tensor_parallel_size, pipeline_parallel_size, init_method, backend)
    _EP_GROUP = tp_group if enable_expert_parallel else GroupCoordinator()
    return tp_group, pp_group


def _init_tp_pp(
    rank: int, tensor_parallel_size: int, pipeline_parallel_size: int, init_method: str, backend: str
) -> tuple[GroupCoordinator, GroupCoordinator]:
    global _TP_GROUP, _PP_GROUP
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world = tp * pp
    if world == 1:
        _TP_GROUP, _PP_GROUP = GroupCoordinator(), GroupCoordinator()
        return _TP_GROUP, _PP_GROUP
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world)
    pp_rank, tp_rank = divmod(rank, tp)
    if pp == 1:
        _TP_GROUP = GroupCoordinator(tp_rank, tp, dist.group.WORLD, list(range(world)))
        _PP_GROUP = GroupCoordinator()
        return _TP_GROUP, _PP_GROUP
    # every rank creates every group, in the same order (torch.distributed's rule for new_group)
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks) if tp > 1 else None
        if stage == pp_rank:
            _TP_GROUP = GroupCoordinator(tp_rank, tp, group, ranks)
    for column in range(tp):
        ranks = list(range(column, world, tp))
        group = dist.new_group(ranks)
        if column == tp_rank:
            _PP_GROUP = GroupCoordinator(pp_rank, pp, group, ranks)
    return _TP_GROUP, _PP_GROUP


def destroy_model_parallel() -> None:
    global _TP_GROUP, _PP_GROUP, _EP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP, _PP_GROUP, _EP_GROUP = GroupCoordinator(), GroupCoordinator(), GroupCoordinator()


def pipeline_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage ``pp_rank`` holds: contiguous slices, the first stages
    taking one extra layer each when the count does not divide (every stage holds at least one layer)."""
    if pp_size > num_layers:
        raise ValueError(
            f"parallel.pipeline_parallel_size ({pp_size}) exceeds the model's {num_layers} layers: "
            "every stage must hold at least one layer"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
