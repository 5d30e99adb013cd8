"""Torch reference of the Mamba kernels (every faster implementation is checked against these): the causal
depthwise convolution and the Mamba2 selective scan, over a batch of requests laid end to end (``query_start_loc``)
with each request's running state carried in and out.

The scan runs a request of one token as the single-step state update and a longer one in the chunked (SSD) form:
within a chunk the output is an attention-like product masked by the decays, across chunks the state carries.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: Sequence[int],
    activation: str | None = "silu",
) -> torch.Tensor:
    """x [T, C] (requests end to end), weight [C, K], conv_state [R, C, K - 1] (each request's last K - 1 inputs,
    zero for a request that starts): returns [T, C] and leaves each request's last K - 1 inputs in conv_state."""
    kernel = weight.shape[1]
    out = torch.empty_like(x)
    w = weight.float()
    for row in range(len(query_start_loc) - 1):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        if end == start:
            continue
        inputs = torch.cat([conv_state[row].transpose(0, 1).to(x.dtype), x[start:end]])  # [K - 1 + L, C]
        windows = inputs.float().unfold(0, kernel, 1)  # [L, C, K]
        y = (windows * w).sum(-1)
        if bias is not None:
            y = y + bias.float()
        if activation == "silu":
            y = F.silu(y)
        out[start:end] = y.to(x.dtype)
        conv_state[row] = inputs[-(kernel - 1) :].transpose(0, 1).to(conv_state.dtype)
    return out


def _discretized_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])


def mamba2_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """One token per request: x [R, H, P], dt [R, H], B and C [R, G, N], ssm_state [R, H, P, N] (updated in place).
    Returns y [R, H, P] in float32."""
    heads, groups = x.shape[1], B.shape[1]
    step = _discretized_dt(dt, dt_bias, dt_limit)  # [R, H]
    decay = torch.exp(step * A.float())  # [R, H]
    b = B.float().repeat_interleave(heads // groups, dim=1)  # [R, H, N]
    c = C.float().repeat_interleave(heads // groups, dim=1)
    xf = x.float()
    state = ssm_state.float() * decay[:, :, None, None] + (step[:, :, None] * xf)[..., None] * b[:, :, None, :]
    ssm_state.copy_(state.to(ssm_state.dtype))
    return torch.einsum("rhpn,rhn->rhp", state, c) + D.float()[:, None] * xf


def mamba2_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens: x [L, H, P], dt [L, H], B and C [L, G, N], state [H, P, N] at the start. Returns
    (y [L, H, P], the state after the last token), both float32."""
    heads, groups = x.shape[1], B.shape[1]
    step = _discretized_dt(dt, dt_bias, dt_limit)  # [L, H]
    log_decay = step * A.float()  # [L, H]
    x_dt = x.float() * step[..., None]  # [L, H, P]
    b = B.float().repeat_interleave(heads // groups, dim=1)  # [L, H, N]
    c = C.float().repeat_interleave(heads // groups, dim=1)
    state = state.float()
    outputs = []
    for start in range(0, x.shape[0], chunk_size):
        end = min(start + chunk_size, x.shape[0])
        cum = torch.cumsum(log_decay[start:end], dim=0)  # [Q, H]: log decay from the chunk's start through l
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        # decay from source s to target l (l >= s): exp(cum[l] - cum[s])
        pair_decay = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
        scores = torch.einsum("lhn,shn->lsh", c[start:end], b[start:end]) * pair_decay
        y = torch.einsum("lsh,shp->lhp", scores, x_dt[start:end])
        y = y + torch.einsum("lhn,hpn->lhp", c[start:end], state) * cum.exp()[..., None]
        to_end = (cum[-1:] - cum).exp()  # [Q, H]: decay from each token to the chunk's end
        state = state * cum[-1].exp()[:, None, None] + torch.einsum(
            "lh,lhp,lhn->hpn", to_end, x_dt[start:end], b[start:end]
        )
        outputs.append(y)
    y = torch.cat(outputs) + D.float()[:, None] * x.float()
    return y, state


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    query_start_loc: Sequence[int],
    chunk_size: int,
) -> torch.Tensor:
    """Requests end to end: x [T, H, P], dt [T, H], B and C [T, G, N], ssm_state [R, H, P, N] (each request's state,
    zero for one that starts; updated in place). Returns y [T, H, P] in float32: the single-step update for every
    one-token request at once, the chunked scan for each longer one."""
    starts = torch.as_tensor(list(query_start_loc), dtype=torch.int64)
    lengths = starts[1:] - starts[:-1]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    single = torch.nonzero(lengths == 1).flatten()
    if len(single):
        tokens = starts[single]
        states = ssm_state[single]
        y[tokens] = mamba2_state_update(x[tokens], dt[tokens], A, B[tokens], C[tokens], D, dt_bias, dt_limit, states)
        ssm_state[single] = states
    for row in torch.nonzero(lengths > 1).flatten().tolist():
        start, end = int(starts[row]), int(starts[row + 1])
        y[start:end], final = mamba2_chunked_scan(
            x[start:end], dt[start:end], A, B[start:end], C[start:end], D, dt_bias, dt_limit, ssm_state[row], chunk_size
        )
        ssm_state[row] = final.to(ssm_state.dtype)
    return y


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: Sequence[int],
) -> torch.Tensor:
    """Mamba1 (Jamba) over requests end to end: x, z and dt ``[T, D]`` (dt before ``softplus(dt + dt_bias)``),
    A ``[D, N]``, B and C ``[T, N]`` shared by every channel, ssm_state ``[R, D, N]`` (updated in place). Per token:
    ``h = exp(dt A) h + dt x B``, ``y = (h C + D x) silu(z)``. Returns y ``[T, D]`` in float32; every request's
    tokens one after another (the state of a channel decays per state dimension, which has no chunked form as
    cheap as Mamba2's), all requests at once."""
    starts = torch.as_tensor(list(query_start_loc), dtype=torch.int64)
    lengths = (starts[1:] - starts[:-1]).tolist()
    step = F.softplus(dt.float() + dt_bias.float())  # [T, D]
    a = A.float()
    xf, bf, cf = x.float(), B.float(), C.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    state = ssm_state.float()
    for offset in range(max(lengths, default=0)):
        rows = torch.tensor([r for r, length in enumerate(lengths) if length > offset], dtype=torch.int64)
        tokens = starts[rows] + offset
        h = (
            state[rows] * torch.exp(step[tokens, :, None] * a)
            + (step[tokens] * xf[tokens])[:, :, None] * bf[tokens, None, :]
        )
        state[rows] = h
        y[tokens] = torch.einsum("rdn,rn->rd", h, cf[tokens])
    ssm_state.copy_(state.to(ssm_state.dtype))
    return (y + D.float() * xf) * F.silu(z.float())
