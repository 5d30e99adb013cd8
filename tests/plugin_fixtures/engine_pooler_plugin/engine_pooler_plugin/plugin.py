"""A third-party pooler: the element-wise maximum over every prompt token's hidden state."""

import torch

from engine import hookimpl
from engine.interfaces.pooler import Pooler, PoolingBatch

ENGINE_CONTRACT_VERSION = "1.15"


class MaxPooler(Pooler):
    name = "max"
    positions = "all"

    def pool(self, batch: PoolingBatch) -> torch.Tensor:
        return torch.stack([states.max(dim=0).values for states in batch.hidden_states])


@hookimpl
def engine_poolers():
    return [MaxPooler]
