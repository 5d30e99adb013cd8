"""The batched LoRA product for CPUs (``csrc/lora.cpp``): one C++ call per layer and step that shrinks each LoRA
token with its own slot's A and expands with its own slot's B, reading only the B columns of the token's output
slice in a merged layer (q/k/v, gate/up), where the torch forms multiply B's zero blocks too. Each row's sums run in
one fixed order, whatever the batch: the product is batch-invariant.

It takes every step size (``scripts/bench_lora_product.py``, SmolLM2's four LoRA layers, 4 slots of rank 16, AVX2
EPYC: 4x faster than the torch forms at 64 tokens, 2x at 1,024). At 2,048 tokens whose adapters each form one run
the grouped torch GEMMs are about 1.2x faster, but a prompt step's requests interleave adapters and the grouped form
then gathers their rows: on W1's prompt steps the kernel spent 2.7 s where the grouped form spent 6.4 s.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional, Sequence

import torch


def load_lora_ops():
    """The ``_lora`` extension, or None where it is not built (the torch reference then runs)."""
    if importlib.util.find_spec("engine_attention_cpu._lora") is None:
        return None
    from engine_attention_cpu import _lora

    return _lora


def kernel_takes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether the C++ kernel takes these operands (CPU rows of one float dtype, float32 adapters)."""
    return (
        y.device.type == "cpu"
        and lora_a.device.type == "cpu"
        and y.dim() == 2
        and x.dim() == 2
        and x.dtype == y.dtype
        and y.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and y.stride(-1) == 1
        and x.stride(-1) == 1
        and lora_a.dtype == torch.float32
        and lora_b.dtype == torch.float32
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
    )


def add_lora_kernel(
    ops: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: Any,
    out_slices: Optional[Sequence[tuple[int, int]]],
) -> torch.Tensor:
    """``LayerKernels.add_lora`` in one C++ call (B dense where ``out_slices`` is None)."""
    slices = out_slices or ((0, y.shape[1]),)
    return ops.add_lora(
        y, x, lora_a, lora_b, mapping.token_slots, [offset for offset, _ in slices], [size for _, size in slices]
    )
