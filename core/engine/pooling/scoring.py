"""Scoring as vLLM's ``score`` / ``rerank``: which (query, document) pairs a call makes, and how an embedding model
scores one (the cosine similarity of the two embeddings; a cross-encoder reads the pair jointly instead)."""

from __future__ import annotations

import math
from typing import Sequence, Union

from engine.errors import InvalidParameterError

TextOrTexts = Union[str, Sequence[str]]


def score_pairs(text_1: TextOrTexts, text_2: TextOrTexts) -> list[tuple[str, str]]:
    """1 x N (one query, many documents) or N x N (pairwise) pairs, as vLLM pairs them."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise InvalidParameterError("scoring needs at least one text on each side", "text_1" if not first else "text_2")
    for side, texts in (("text_1", first), ("text_2", second)):
        if not all(isinstance(text, str) for text in texts):
            raise InvalidParameterError(f"{side} must be a string or a list of strings", side)
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise InvalidParameterError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2", "text_2"
        )
    return list(zip(first, second))


def scores_jointly(model_info) -> bool:
    """True: a cross-encoder (it reads each pair in one prompt); False: an embedding model (cosine similarity of the
    two embeddings); InvalidParameterError for a model that scores no pairs."""
    pooling = model_info.pooling
    if pooling is None:
        raise InvalidParameterError(
            f"{model_info.architecture} is a generative model: it scores no pairs (serve a pooling model)", "model"
        )
    if "score" in pooling.tasks:
        return True
    if "embed" in pooling.tasks:
        return False
    raise InvalidParameterError(
        f"{model_info.architecture} scores no pairs: the task 'score' needs a cross-encoder (a classifier with one "
        f"label) or an embedding model; this one is a classifier with {pooling.num_labels} labels",
        "model",
    )


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0
