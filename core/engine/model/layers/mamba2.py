"""The Mamba2 mixer (Bamba, Granite 4.0-H): input projection, causal convolution, selective scan with the
state carried per request in the paged cache, gated RMSNorm and output projection."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.kernels import current_layer_kernels
from engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.model.layers.mamba_state import ConvWeights, MambaLayer


class RMSNormGated(nn.Module):
    """``rms_norm(x * silu(gate))`` over groups of ``group_size`` channels, in float32 (Mamba2's gated norm with the
    gate applied before the norm)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = x.float() * F.silu(gate.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.view(gated.shape).to(x.dtype)


class MambaMixer2(MambaLayer):
    """One Mamba2 layer over the step's tokens (requests end to end, each with its state in its state block)."""

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
        self.layer_name = layer_name
        self.state_dtype = dtype
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.activation = activation
        self.time_step_limit = tuple(time_step_limit or (0.0, float("inf")))
        self.in_proj = ColumnParallelLinear(
            hidden_size, [self.intermediate_size + self.conv_dim + num_heads], bias=use_bias
        )
        self.conv1d = ConvWeights(self.conv_dim, conv_kernel, use_conv_bias)
        self.A_log = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.norm = RMSNormGated(self.intermediate_size, self.intermediate_size // n_groups, eps)
        self.out_proj = RowParallelLinear(self.intermediate_size, hidden_size, bias=use_bias)
        self.kernels = current_layer_kernels()

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """(conv state ``[conv_dim, K - 1]``, SSM state ``[heads, head_dim, state_size]``)."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = self.metadata()
        state = self.bound_state()
        conv_state, ssm_state = state.read(metadata.state_blocks, metadata.starts)
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
        state.write(metadata.state_blocks, [conv_state, ssm_state])
        y = self.norm(y.reshape(tokens, self.intermediate_size), gate)
        return self.out_proj(y.to(hidden_states.dtype))
