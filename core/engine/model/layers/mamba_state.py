"""A Mamba layer's per-request state in the paged cache: the step's metadata (which block each request's state is
read from and written to, and whether the request starts), the view of a cache tensor as state pages, and the base
class the model runner binds them to."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.interfaces.attention import AttentionMetadataBuilder, CommonAttentionMetadata


@dataclass
class MambaMetadata:
    """One step of a Mamba group: request ``i`` runs tokens ``query_start_loc[i]:query_start_loc[i + 1]`` from the
    state in block ``source_blocks[i]`` and leaves its state in block ``dest_blocks[i]`` (the same block, or the one
    of its last token when the step enters a new block: see ``MambaManager``); ``starts[i]`` says the request starts
    from position 0 (its state is reset, whatever the block held)."""

    query_start_loc: np.ndarray  # [R + 1]
    source_blocks: torch.Tensor  # [R] int64
    dest_blocks: torch.Tensor  # [R] int64
    starts: torch.Tensor  # [R] bool


class MambaMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`MambaMetadata` from the common metadata: a Mamba group's block table is positional, and the
    state after ``n`` tokens is in the block of token ``n - 1``."""

    def build(self, common: CommonAttentionMetadata) -> MambaMetadata:
        computed = common.num_computed_tokens_np
        rows = torch.arange(common.num_reqs)
        source_columns = torch.from_numpy(np.maximum(computed - 1, 0) // self.block_size)
        dest_columns = torch.from_numpy((common.seq_lens_np - 1) // self.block_size)
        table = common.block_table
        return MambaMetadata(
            common.query_start_loc_np,
            table[rows, source_columns].to(torch.int64),
            table[rows, dest_columns].to(torch.int64),
            torch.from_numpy(computed == 0),
        )


class MambaStateCache:
    """A Mamba layer's states as pages of a cache tensor it may share with attention layers (each block id's
    bytes in that tensor belong to one layer at a time). The block dimension may be the first or the second (K/V
    stacked first: ``block_dim`` says which), so a page is read as ``[outer, block, inner]`` and a state is its
    ``outer * inner`` elements, of which the first are the conv state ``[C, K - 1]`` and then the SSM state."""

    def __init__(self, tensor: torch.Tensor, block_dim: int, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype):
        if not tensor.is_contiguous():
            raise ValueError(f"a Mamba layer's pages need a contiguous cache tensor, not one of {tuple(tensor.shape)}")
        num_blocks = tensor.shape[block_dim]
        outer = math.prod(tensor.shape[:block_dim])
        if tensor.dtype != dtype:
            tensor = tensor.view(torch.uint8).view(dtype)
        self.pages = tensor.view(outer, num_blocks, -1)
        self.shapes = shapes
        self.sizes = [math.prod(shape) for shape in shapes]
        if sum(self.sizes) > outer * self.pages.shape[2]:
            raise ValueError(f"a Mamba state of {sum(self.sizes)} elements does not fit in a page of {tensor.shape}")

    def read(self, blocks: torch.Tensor, starts: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """The states of the given blocks as new tensors ``[R, *shape]`` (zeros where ``starts``)."""
        flat = self.pages[:, blocks].transpose(0, 1).reshape(len(blocks), -1)  # a copy: indexing gathers
        if starts is not None and bool(starts.any()):
            flat[starts] = 0
        states = flat[:, : sum(self.sizes)].split(self.sizes, dim=1)
        return [state.reshape(len(blocks), *shape).contiguous() for state, shape in zip(states, self.shapes)]

    def write(self, blocks: torch.Tensor, states: list[Any]) -> None:
        """Store the states of the given blocks."""
        outer, _, inner = self.pages.shape
        flat = torch.zeros(len(blocks), outer * inner, dtype=self.pages.dtype, device=self.pages.device)
        at = 0
        for state, size in zip(states, self.sizes):
            flat[:, at : at + size] = state.reshape(len(blocks), size)
            at += size
        self.pages[:, blocks] = flat.view(len(blocks), outer, inner).transpose(0, 1)


class MambaLayer(nn.Module):
    """What the model runner sees of a state-space layer: its name, the shapes and dtype of its per-request state,
    and the cache view and KV-cache group it binds to."""

    layer_name: str
    state_dtype: torch.dtype

    def __init__(self) -> None:
        super().__init__()
        self.state: Optional[MambaStateCache] = None
        self.kv_cache_group = 0

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def metadata(self) -> MambaMetadata:
        return get_forward_context().attn_metadata[self.kv_cache_group]

    def bound_state(self) -> MambaStateCache:
        if self.state is None:
            raise RuntimeError(f"{self.layer_name} runs before the model runner bound its state cache")
        return self.state


class ConvWeights(nn.Module):
    """A depthwise causal convolution's parameters as checkpoints name them: ``weight [C, 1, K]``, ``bias [C]``."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    @property
    def kernel(self) -> torch.Tensor:
        """``[C, K]``."""
        return self.weight[:, 0]


def checkpoint_rows(*pieces: tuple[int, int]) -> torch.Tensor:
    """The checkpoint rows ``[start, start + count)`` of each piece, in order."""
    return torch.cat([torch.arange(start, start + count) for start, count in pieces])


def rows_loader(rows: torch.Tensor):
    """A weight loader that copies the given rows of the checkpoint tensor (this rank's)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        param.data.copy_(loaded[rows].reshape(param.shape))

    return load
