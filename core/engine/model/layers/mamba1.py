"""The Mamba1 mixer (Jamba): input projection into x and its gate, causal convolution, the input-dependent time
step, B and C (each RMS-normed, as Jamba does), the selective scan with the state carried per request in the paged
cache, and the output projection."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_group
from engine.model.layers.kernels import current_layer_kernels
from engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.model.layers.mamba_state import ConvWeights, MambaLayer, checkpoint_rows, rows_loader
from engine.model.layers.norm import RMSNorm


class MambaMixer(MambaLayer):
    """One Mamba1 layer over the step's tokens (requests end to end, each with its state in its state block).

    Tensor parallelism splits the channels (x, its gate, the convolution, dt's projection, A and D); ``x_proj``
    reads all of them, so its product is summed over the ranks and every rank has the whole time step, B and C."""

    def __init__(
        self,
        layer_name: str,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        eps: float,
        dtype: torch.dtype,
        use_conv_bias: bool = True,
        use_bias: bool = False,
    ):
        super().__init__()
        tp = get_tp_group()
        if intermediate_size % tp.world_size:
            raise ValueError(
                f"a Mamba layer of {intermediate_size} channels cannot be split over "
                f"tensor_parallel_size={tp.world_size}"
            )
        self.layer_name = layer_name
        self.state_dtype = dtype
        self.intermediate_size = intermediate_size // tp.world_size  # this rank's channels
        self.state_size, self.conv_kernel, self.time_step_rank = state_size, conv_kernel, time_step_rank
        channels = (tp.rank * self.intermediate_size, self.intermediate_size)
        self.in_proj = ColumnParallelLinear(hidden_size, [2 * intermediate_size], bias=use_bias)
        self.conv1d = ConvWeights(self.intermediate_size, conv_kernel, use_conv_bias)
        # the time step, B and C read every channel: this rank's share of the product, summed over the ranks
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + 2 * state_size)
        self.dt_proj = ColumnParallelLinear(time_step_rank, [intermediate_size], bias=True)
        self.dt_layernorm = RMSNorm(time_step_rank, eps)
        self.b_layernorm = RMSNorm(state_size, eps)
        self.c_layernorm = RMSNorm(state_size, eps)
        self.A_log = nn.Parameter(torch.empty(self.intermediate_size, state_size), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.intermediate_size), requires_grad=False)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias)
        # the checkpoint's in_proj is [x | gate]: this rank's rows of each
        in_proj_rows = checkpoint_rows(channels, (intermediate_size + channels[0], channels[1]))
        channel_rows = checkpoint_rows(channels)
        for param, rows in (
            (self.in_proj.weight, in_proj_rows),
            (self.in_proj.bias, in_proj_rows),
            (self.conv1d.weight, channel_rows),
            (self.conv1d.bias, channel_rows),
            (self.A_log, channel_rows),
            (self.D, channel_rows),
        ):
            if param is not None:
                param.weight_loader = rows_loader(rows)  # type: ignore[attr-defined]
        self.register_buffer("no_dt_bias", torch.zeros(self.intermediate_size), persistent=False)
        self.kernels = current_layer_kernels()

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """(conv state ``[intermediate, K - 1]``, SSM state ``[intermediate, state_size]``)."""
        return (self.intermediate_size, self.conv_kernel - 1), (self.intermediate_size, self.state_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = self.metadata()
        state = self.bound_state()
        conv_state, ssm_state = state.read(metadata.source_blocks, metadata.starts)
        x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)
        kernels: Any = self.kernels
        x = kernels.causal_conv1d(
            x.contiguous(), self.conv1d.kernel, self.conv1d.bias, conv_state, metadata.query_start_loc
        )
        time_step, B, C = self.x_proj(x).split([self.time_step_rank, self.state_size, self.state_size], dim=-1)
        dt = self.dt_proj(self.dt_layernorm(time_step.contiguous()))  # with its bias: the scan adds none
        y = kernels.selective_scan(
            x,
            dt,
            -torch.exp(self.A_log.float()),
            self.b_layernorm(B.contiguous()),
            self.c_layernorm(C.contiguous()),
            self.D,
            gate,
            self.no_dt_bias,
            ssm_state,
            metadata.query_start_loc,
        )
        state.write(metadata.dest_blocks, [conv_state, ssm_state])
        return self.out_proj(y.to(hidden_states.dtype))
