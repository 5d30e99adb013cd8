"""Pooler interface: the hidden states of one prompt -> one vector (a pooling model's embedding, or the input
of its classifier)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from engine.interfaces.base import Pluggable, SelectionContext

if TYPE_CHECKING:
    from engine.config import VllmConfig


@dataclass
class PoolingBatch:
    """The requests that finished their prompt in a step, one entry each.

    ``hidden_states[i]`` holds request i's final hidden states at the positions the pooler asks for
    (``Pooler.positions``): ``[1, H]`` for ``last`` and ``first``, ``[prompt_len, H]`` for ``all`` (gathered over
    the prompt's chunks when it was prefilled in several steps)."""

    req_ids: list[str]
    hidden_states: list[torch.Tensor]
    prompt_lens: list[int]


class Pooler(Pluggable):
    """A pooling method (vLLM's ``PoolingType``): which positions it reads and how it reduces them.

    Constructed once per worker of a pooling model as ``cls(vllm_config)``; ``pool(batch)`` returns a
    ``[len(batch.req_ids), H]`` tensor. ``auto`` prefers the built-in that the checkpoint names; a third-party
    pooler is chosen by name (``pooler.pooling_type``), or by ``auto`` where its ``preferred_for`` says so.
    """

    positions: ClassVar[Literal["last", "first", "all"]] = "all"

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config

    @classmethod
    def preferred_for(cls, ctx: SelectionContext) -> bool:
        info = ctx.model_info
        return info is not None and info.pooling is not None and info.pooling.pooling_type == cls.name

    @abstractmethod
    def pool(self, batch: PoolingBatch) -> torch.Tensor: ...
