"""What follows the pooler: an embedding's Matryoshka truncation and normalisation, or a classifier's logits and
activation (vLLM's pooler heads)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.config import PoolerConfig
from engine.model.pooling_info import PoolingInfo
from engine.pooling_params import PoolingParams


class PoolingHead:
    """Turns pooled vectors into each request's result, by its task."""

    def __init__(self, model: Any, info: PoolingInfo, config: PoolerConfig):
        self.model = model
        self.info = info
        self.config = config

    def classifier_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, num_labels] float32: the model's classifier, or a causal LM's logits of ``classifier_from_token``
        (two tokens: positive minus negative, whose sigmoid is the softmax over the pair)."""
        token_ids = self.info.classifier_token_ids
        if token_ids is None:
            return self.model.classify(pooled).float()
        logits = self.model.compute_logits(pooled)[:, token_ids].float()
        return logits[:, 1:] - logits[:, :1] if len(token_ids) == 2 else logits

    def __call__(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[list[float]]:
        results: list[list[float]] = [[] for _ in params]
        embed = [i for i, p in enumerate(params) if p.task in ("embed", "encode")]
        classify = [i for i, p in enumerate(params) if p.task in ("classify", "score")]
        for i in embed:
            vector = pooled[i].float()
            if params[i].task == "embed":
                if params[i].dimensions is not None:
                    vector = vector[: params[i].dimensions]
                normalize = params[i].normalize if params[i].normalize is not None else self.info.normalize
                if normalize:
                    vector = F.normalize(vector, dim=-1)
            results[i] = vector.tolist()
        if classify:
            logits = self.classifier_logits(pooled[torch.tensor(classify, device=pooled.device)])
            for row, i in enumerate(classify):
                values = logits[row]
                activation = params[i].activation if params[i].activation is not None else self.config.activation
                if activation:
                    values = values.sigmoid() if len(values) == 1 else values.softmax(dim=-1)
                results[i] = values.tolist()
        return results
