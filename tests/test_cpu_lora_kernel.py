"""The cpu plugin's batched LoRA kernel (``csrc/lora.cpp``) against each token's own product: merged layers whose B
is block-diagonal (only each slice's own columns read), dense B, every activation dtype, vector tails (ranks and
widths that are not multiples of 8), scattered slots and base-model rows; and its rows are the same bits alone as in
any batch (what ``model.batch_invariant`` needs of it)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engine.lora.mapping import LoRAMapping
from engine.model.layers.lora_reference import add_lora as add_lora_reference

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine_attention_cpu._lora") is None, reason="the cpu LoRA kernel is not built"
)

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
TOLERANCE[torch.float16] = dict(atol=2e-3, rtol=2e-3)


def block_diagonal(gen, slots: int, rank: int, in_features: int, slices: list[tuple[int, int]]):
    """A ``[slots, slices * rank, in]`` and B ``[out, slots, slices * rank]`` zero outside each slice's own block."""
    width = len(slices) * rank
    out = max(offset + size for offset, size in slices)
    lora_a = torch.randn(slots, width, in_features, generator=gen)
    lora_b = torch.zeros(out, slots, width)
    for index, (offset, size) in enumerate(slices):
        block = torch.randn(size, slots, rank, generator=gen) * 0.1
        lora_b[offset : offset + size, :, index * rank : (index + 1) * rank] = block
    return lora_a, lora_b


def each_tokens_own(y, x, lora_a, lora_b, token_slots):
    want = y.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            want[t] += (lora_b[:, slot] @ (lora_a[slot] @ x[t].float())).to(y.dtype)
    return want


@pytest.fixture(scope="module")
def cpu():
    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    return CpuLayerKernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "rank, in_features, slices",
    [
        (16, 96, [(0, 64), (64, 32), (96, 32)]),  # q/k/v-shaped
        (8, 40, [(0, 24), (24, 24)]),  # gate/up-shaped
        (4, 37, [(0, 13)]),  # no multiple of 8 anywhere: every scalar tail
        (12, 72, [(0, 20), (20, 19)]),  # rank 12: one vector and a tail
    ],
    ids=["qkv", "gate-up", "tails", "rank12"],
)
def test_kernel_equals_each_tokens_own_product(cpu, dtype, rank, in_features, slices):
    gen = torch.Generator().manual_seed(3)
    lora_a, lora_b = block_diagonal(gen, 3, rank, in_features, slices)
    token_slots = [1, -1, 0, 1, 2, 0, -1, 2, 2, 2, 1, 0, 0]
    x = torch.randn(len(token_slots), in_features, generator=gen).to(dtype)
    y = torch.randn(len(token_slots), lora_b.shape[0], generator=gen).to(dtype)
    mapping = LoRAMapping.from_token_slots(np.array(token_slots))
    want = each_tokens_own(y, x, lora_a, lora_b, token_slots)
    got = cpu.add_lora(y.clone(), x, lora_a, lora_b, mapping, out_slices=slices)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    dense = cpu.add_lora(y.clone(), x, lora_a, lora_b, mapping)  # without out_slices: every column of B
    torch.testing.assert_close(dense, want, **TOLERANCE[dtype])
    base_rows = [t for t, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows are left as they were


def test_kernel_reads_only_each_slices_own_columns(cpu):
    """With out_slices, B's values outside a slice's block are never read (a kernel that multiplied them would
    differ here); without, they count, as the reference counts them."""
    gen = torch.Generator().manual_seed(5)
    slices = [(0, 16), (16, 16)]
    lora_a, lora_b = block_diagonal(gen, 2, 8, 32, slices)
    want_b = lora_b.clone()
    lora_b[0:16, :, 8:16] = 1e3  # slice 0's rows, slice 1's columns
    token_slots = [0, 1, 1]
    x = torch.randn(3, 32, generator=gen)
    y = torch.zeros(3, 32)
    mapping = LoRAMapping.from_token_slots(np.array(token_slots))
    got = cpu.add_lora(y.clone(), x, lora_a, lora_b, mapping, out_slices=slices)
    torch.testing.assert_close(got, each_tokens_own(y, x, lora_a, want_b, token_slots))
    dense = cpu.add_lora(y.clone(), x, lora_a, lora_b, mapping)
    torch.testing.assert_close(dense, add_lora_reference(y.clone(), x, lora_a, lora_b, mapping), rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_the_batch(cpu, dtype):
    """Row 0 computed alone, then among 1..300 other rows of other slots and the base model (the kernel's threads
    split the larger calls; rows of one slot go two by two through A and eight by eight through B), gives the same
    bits every time."""
    gen = torch.Generator().manual_seed(9)
    slices = [(0, 576), (576, 192), (768, 192)]
    lora_a, lora_b = block_diagonal(gen, 4, 16, 576, slices)
    x0 = torch.randn(1, 576, generator=gen).to(dtype)
    y0 = torch.randn(1, 960, generator=gen).to(dtype)
    alone = cpu.add_lora(y0.clone(), x0, lora_a, lora_b, LoRAMapping.from_token_slots(np.array([2])), slices)
    for others in (1, 7, 63, 300):
        slots = np.concatenate([[2], np.arange(others) % 5 - 1])  # slots -1..3
        x = torch.cat([x0, torch.randn(others, 576, generator=gen).to(dtype)])
        y = torch.cat([y0, torch.randn(others, 960, generator=gen).to(dtype)])
        got = cpu.add_lora(y, x, lora_a, lora_b, LoRAMapping.from_token_slots(slots), slices)
        assert torch.equal(got[:1], alone), others
