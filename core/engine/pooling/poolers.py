"""The built-in poolers (vLLM's LAST, MEAN and CLS pooling types)."""

from __future__ import annotations

import torch

from engine.hookspecs import hookimpl
from engine.interfaces.pooler import Pooler, PoolingBatch


class LastPooler(Pooler):
    """The last prompt token's hidden state (decoder embedders: Qwen3-Embedding, e5-mistral; rerankers)."""

    name = "last"
    positions = "last"

    def pool(self, batch: PoolingBatch) -> torch.Tensor:
        return torch.cat(batch.hidden_states)


class ClsPooler(Pooler):
    """The first token's hidden state (BERT's [CLS])."""

    name = "cls"
    positions = "first"

    def pool(self, batch: PoolingBatch) -> torch.Tensor:
        return torch.cat(batch.hidden_states)


class MeanPooler(Pooler):
    """The mean over every prompt token's hidden state (most sentence-transformers models), summed in float32."""

    name = "mean"
    positions = "all"

    def pool(self, batch: PoolingBatch) -> torch.Tensor:
        return torch.stack([states.float().mean(dim=0) for states in batch.hidden_states]).to(
            batch.hidden_states[0].dtype
        )


@hookimpl
def engine_poolers():
    return [LastPooler, ClsPooler, MeanPooler]
