"""Percentiles, environment description and the JSON report shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import resource
from typing import Iterable

import numpy as np


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float]:
    data = np.asarray(list(values), dtype=float) * scale
    if data.size == 0:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    return {
        "mean": float(data.mean()),
        "median": float(np.median(data)),
        "p90": float(np.percentile(data, 90)),
        "p99": float(np.percentile(data, 99)),
    }


def peak_rss_mib() -> float:
    """Peak resident memory of this process and its finished children, MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024, 1)


def environment() -> dict:
    """The machine, torch, and what the engine and its peers ran with (``variables``: the engine-only settings,
    which peers do not inherit)."""
    import torch

    from engine_bench.peers import environments_report

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "variables": environments_report(),
    }


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
