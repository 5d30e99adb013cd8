"""Shared availability checks for CUDA-only backends (a library is imported lazily, only to run)."""

from __future__ import annotations

import importlib.util

import torch


def cuda_library_reasons(module: str, install_hint: str) -> list[str]:
    """The true reasons a CUDA library backend cannot run here: no device, library missing, or both."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device")
    if importlib.util.find_spec(module) is None:
        reasons.append(f"{module} is not installed ({install_hint})")
    return reasons
