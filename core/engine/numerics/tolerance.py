"""The activation tolerance table: the relative error against float64 on the same weights that a correct
implementation's activations stay under, by dtype and depth (docs/numerics.md justifies the figures).

Errors of different ops add up like a random walk through the layers, so the bound at layer ``l`` (0-based) is
``base x sqrt(l + 1)``; the final norm counts as one layer past the last."""

from __future__ import annotations

import math

ACTIVATION_BASE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2, "float64": 1e-12}


def activation_tolerance(dtype: str, layer: int = 0) -> float:
    name = str(dtype).removeprefix("torch.")
    if name not in ACTIVATION_BASE:
        raise ValueError(f"no activation tolerance for dtype {dtype!r}; known: {sorted(ACTIVATION_BASE)}")
    return ACTIVATION_BASE[name] * math.sqrt(layer + 1)
