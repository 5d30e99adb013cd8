"""The Mamba2 mixer (Bamba, Granite 4.0-H): input projection, causal convolution, selective scan with the
state carried per request in the paged cache, gated RMSNorm and output projection."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group
from engine.model.layers.kernels import current_layer_kernels
from engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.model.layers.mamba_state import ConvWeights, MambaLayer, checkpoint_rows, rows_loader


class RMSNormGated(nn.Module):
    """``rms_norm(x * silu(gate))`` over groups of ``group_size`` channels, in float32 (Mamba2's gated norm with the
    gate applied before the norm). ``tp_group``: this rank holds a slice of one group that spans the ranks (one
    group under tensor parallelism), whose mean square is summed over them."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, tp_group: Any = None, full_size: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size = group_size
        self.eps = eps
        self.tp_group = tp_group
        self.full_size = full_size

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = x.float() * F.silu(gate.float())
        if self.tp_group is not None:
            mean_square = self.tp_group.all_reduce(gated.pow(2).sum(-1, keepdim=True)) / self.full_size
            return self.weight * (gated * torch.rsqrt(mean_square + self.eps)).to(x.dtype)
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.view(gated.shape).to(x.dtype)


class MambaMixer2(MambaLayer):
    """One Mamba2 layer over the step's tokens (requests end to end, each with its state in its state block).

    Tensor parallelism splits the heads (the gate, x, dt, A, D and the norm's channels with them); B and C are split
    by group when the groups divide among the ranks, else (one group) every rank holds them whole. The checkpoint's
    fused ``in_proj`` ([gate | x | B | C | dt]) and ``conv1d`` ([x | B | C]) load through the rows of this rank.
    """

    def __init__(
        self,
        layer_name: str,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        chunk_size: int,
        eps: float,
        dtype: torch.dtype,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        time_step_limit: Optional[tuple[float, float]] = None,
        activation: str = "silu",
    ):
        super().__init__()
        tp = get_tp_group()
        if num_heads % tp.world_size or (n_groups % tp.world_size and n_groups != 1):
            raise ValueError(
                f"a Mamba2 layer of {num_heads} heads in {n_groups} groups cannot be split over "
                f"tensor_parallel_size={tp.world_size} (the heads, and the groups unless there is one, must divide)"
            )
        self.layer_name = layer_name
        self.state_dtype = dtype
        self.head_dim, self.state_size, self.conv_kernel = head_dim, state_size, conv_kernel
        self.num_heads = num_heads // tp.world_size  # this rank's
        self.n_groups = n_groups // tp.world_size if n_groups % tp.world_size == 0 else n_groups
        self.intermediate_size = self.num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * state_size
        self.chunk_size = chunk_size
        self.activation = activation
        self.time_step_limit = tuple(time_step_limit or (0.0, float("inf")))
        full = num_heads * head_dim
        heads = (tp.rank * self.num_heads, self.num_heads)
        channels = (tp.rank * self.intermediate_size, self.intermediate_size)
        group_rows = self.n_groups * state_size
        first_group = 0 if self.n_groups == n_groups else tp.rank * group_rows
        b_rows, c_rows = (full + first_group, group_rows), (full + n_groups * state_size + first_group, group_rows)
        self.conv_rows = checkpoint_rows((channels[0] + 0, channels[1]), b_rows, c_rows)
        self.in_proj_rows = checkpoint_rows(
            channels,
            (full + channels[0], channels[1]),
            (full + b_rows[0], group_rows),
            (full + c_rows[0], group_rows),
            (2 * full + 2 * n_groups * state_size + heads[0], heads[1]),
        )
        self.head_rows, self.channel_rows = checkpoint_rows(heads), checkpoint_rows(channels)
        local = self.intermediate_size + self.conv_dim + self.num_heads
        self.in_proj = ColumnParallelLinear(hidden_size, [local * tp.world_size], bias=use_bias)
        self.conv1d = ConvWeights(self.conv_dim, conv_kernel, use_conv_bias)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        spans_ranks = n_groups == 1 and tp.world_size > 1
        self.norm = RMSNormGated(
            self.intermediate_size,
            self.intermediate_size // self.n_groups,
            eps,
            tp_group=tp if spans_ranks else None,
            full_size=full,
        )
        self.out_proj = RowParallelLinear(full, hidden_size, bias=use_bias)
        for param, rows in (
            (self.in_proj.weight, self.in_proj_rows),
            (self.in_proj.bias, self.in_proj_rows),
            (self.conv1d.weight, self.conv_rows),
            (self.conv1d.bias, self.conv_rows),
            (self.A_log, self.head_rows),
            (self.D, self.head_rows),
            (self.dt_bias, self.head_rows),
            (self.norm.weight, self.channel_rows),
        ):
            if param is not None:
                param.weight_loader = rows_loader(rows)  # type: ignore[attr-defined]
        self.kernels = current_layer_kernels()

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """This rank's (conv state ``[conv_dim, K - 1]``, SSM state ``[heads, head_dim, state_size]``)."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = self.metadata()
        state = self.bound_state()
        conv_state, ssm_state = state.read(metadata.source_blocks, metadata.starts)
        projected = self.in_proj(hidden_states)
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        kernels: Any = self.kernels
        xbc = kernels.causal_conv1d(
            xbc, self.conv1d.kernel, self.conv1d.bias, conv_state, metadata.query_start_loc, self.activation
        )
        x, B, C = xbc.split(
            [self.intermediate_size, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1
        )
        tokens = x.shape[0]
        y = kernels.mamba2_scan(
            x.reshape(tokens, self.num_heads, self.head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            B.reshape(tokens, self.n_groups, self.state_size),
            C.reshape(tokens, self.n_groups, self.state_size),
            self.D,
            self.dt_bias,
            self.time_step_limit,
            ssm_state,
            metadata.query_start_loc,
            self.chunk_size,
        )
        state.write(metadata.dest_blocks, [conv_state, ssm_state])
        y = self.norm(y.reshape(tokens, self.intermediate_size), gate)
        return self.out_proj(y.to(hidden_states.dtype))
