"""Mamba's kernels for the ``cpu`` layer kernels (``csrc/mamba.cpp``): the convolution and the scans run in float32
on contiguous inputs; states of another dtype go through a float32 copy and are written back."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _with_f32_state(state: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run on a float32 contiguous view of ``state`` (a copy where it is not one), writing the result back."""
    work = state if state.dtype == torch.float32 and state.is_contiguous() else _f32(state)
    out = run(work)
    if work is not state:
        state.copy_(work)
    return out


def _starts(query_start_loc: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(query_start_loc, dtype=torch.int64)


def causal_conv1d(
    ops,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    query_start_loc: Sequence[int],
    activation: Optional[str],
) -> torch.Tensor:
    bias32 = _f32(bias) if bias is not None else torch.empty(0)
    out = _with_f32_state(
        conv_state,
        lambda state: ops.causal_conv1d(
            _f32(x), _f32(weight), bias32, state, _starts(query_start_loc), activation == "silu"
        ),
    )
    return out.to(x.dtype)


def mamba2_scan(ops, x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, query_start_loc) -> torch.Tensor:
    return _with_f32_state(
        ssm_state,
        lambda state: ops.mamba2_scan(
            _f32(x),
            _f32(dt),
            _f32(A),
            _f32(B),
            _f32(C),
            _f32(D),
            _f32(dt_bias),
            float(dt_limit[0]),
            float(dt_limit[1]),
            state,
            _starts(query_start_loc),
        ),
    )


def selective_scan(ops, x, dt, A, B, C, D, z, dt_bias, ssm_state, query_start_loc) -> torch.Tensor:
    return _with_f32_state(
        ssm_state,
        lambda state: ops.selective_scan(
            _f32(x),
            _f32(dt),
            _f32(A),
            _f32(B),
            _f32(C),
            _f32(D),
            _f32(z),
            _f32(dt_bias),
            state,
            _starts(query_start_loc),
        ),
    )
