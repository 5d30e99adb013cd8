"""The cpu plugin's fused-MoE operation on 16-bit expert panels: widened as they are read, they must give the float32
panels' bits on every path (the GEMV of few-row products in the widest variant, the register tile of larger ones),
and they are used only where they hold every weight exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("engine_attention_cpu._moe")

from engine.model.layers.moe_reference import fused_experts  # noqa: E402
from engine_attention_cpu.gemm import cpu_gemm_available  # noqa: E402
from engine_attention_cpu.moe import NEVER, CpuFusedExperts, lossless_panel_dtype, onednn_dtype  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gemm_available(), reason="the cpu GEMM is not built (needs AVX2)")

BUILDS = [False] + ([True] if importlib.util.find_spec("engine_attention_cpu._moe_emulated") else [])
# rows per expert: the GEMV's row chunks (1-4, a ragged 5 and 9, a full 16) and the register tile's (17, 40)
ROWS = (1, 2, 3, 4, 5, 9, 16, 17, 40)


def experts(dtype: torch.dtype, seed: int = 0):
    """w13 [8, 2*40, 48] and w2 [8, 48, 40] (ragged panels: 80 and 48 columns are not all whole 32-column pairs)
    whose values are exactly ``dtype``'s, stored in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(8, 80, 48, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(8, 48, 40, generator=gen) * 0.2).to(dtype)
    return w13, w2


def routing(rows_per_expert: dict[int, int]):
    """One token per row, routed to one expert each (top-1, weight 1)."""
    ids = torch.tensor([e for e, rows in rows_per_expert.items() for _ in range(rows)]).unsqueeze(1)
    return torch.ones(ids.shape, dtype=torch.float32), ids


@pytest.mark.parametrize("emulated", BUILDS, ids=lambda e: "simde-avx512" if e else "native")
@pytest.mark.parametrize(
    "stored, panels",
    [
        (torch.bfloat16, torch.bfloat16),  # a bfloat16 model
        (torch.float16, torch.float16),  # a float16 model
        (torch.float32, torch.bfloat16),  # a float32 model loaded from a bfloat16 checkpoint
    ],
    ids=["bf16-model", "fp16-model", "fp32-model-bf16-values"],
)
def test_16_bit_panels_give_the_float32_panels_bits(emulated, stored, panels):
    w13, w2 = experts(panels)
    w13, w2 = w13.to(stored), w2.to(stored)
    wide = CpuFusedExperts(w13, w2, NEVER, torch.float32, emulated=emulated)
    narrow = CpuFusedExperts(w13, w2, NEVER, torch.float32, panel_dtype=panels, emulated=emulated)
    assert narrow.w13.dtype == panels and narrow.w13.element_size() * 2 == wide.w13.element_size()
    gen = torch.Generator().manual_seed(1)
    # every row count on its own expert, then a decode-like step (all experts, 1-4 rows), then two top-2 tokens
    layouts = [{e % 8: rows} for e, rows in enumerate(ROWS)] + [{e: 1 + e % 4 for e in range(8)}]
    for layout in layouts:
        weights, ids = routing(layout)
        x = torch.randn(ids.shape[0], 48, generator=gen).to(stored)
        got = narrow(x, weights, ids)
        assert torch.equal(got, wide(x, weights, ids)), layout
        want = fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(got.float(), want, rtol=2e-2 if stored != torch.float32 else 1e-5, atol=1e-2)
    ids = torch.tensor([[0, 5], [5, 7]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    x = torch.randn(2, 48, generator=gen).to(stored)
    expert_map = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(narrow(x, weights, ids, expert_map), wide(x, weights, ids, expert_map))


def test_a_16_bit_panel_dtype_is_offered_only_where_it_holds_every_weight():
    bf16_w13, bf16_w2 = experts(torch.bfloat16)
    assert lossless_panel_dtype(bf16_w13, bf16_w2) == torch.bfloat16
    assert lossless_panel_dtype(bf16_w13.float(), bf16_w2.float()) == torch.bfloat16
    fp16_w13, fp16_w2 = experts(torch.float16)
    assert lossless_panel_dtype(fp16_w13, fp16_w2) == torch.float16
    assert lossless_panel_dtype(fp16_w13.float(), fp16_w2.float()) == torch.float16  # more mantissa than bfloat16
    w13, w2 = experts(torch.float32)
    assert lossless_panel_dtype(w13, w2) is None
    one_off = bf16_w2.float().clone()
    one_off[3, 7, 5] += 2**-20  # one weight between two bfloat16 (and float16) values
    assert lossless_panel_dtype(bf16_w13.float(), one_off) is None


def test_the_layer_kernels_pack_bfloat16_experts_exactly(caplog):
    """``pack_experts`` measures the panels' dtype once per shape and says what it chose; whichever it is, the
    operation equals the float32 panels'."""
    import logging
    from types import SimpleNamespace

    from engine_attention_cpu.layer_kernels import CpuLayerKernels

    kernels = CpuLayerKernels()
    w13, w2 = experts(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="engine_attention_cpu.layer_kernels"):
        packed = kernels.pack_experts(w13, w2)
        kernels.pack_experts(*experts(torch.bfloat16, seed=1))  # the same shapes: no second measurement
    said = [r.getMessage() for r in caplog.records if "panels (exact for these weights)" in r.getMessage()]
    if packed.onednn_min_rows > 1:  # the panels take some products
        assert len(said) == 1, said
        assert packed.panel_dtype in (torch.float32, torch.bfloat16)
        assert said[0].startswith(f"experts 8x80x48: {str(packed.panel_dtype).replace('torch.', '')} panels"), said
    else:
        assert said == [] and packed.w13 is None
    layer = SimpleNamespace(w13_weight=w13, w2_weight=w2, expert_map=None, packed=packed)
    weights, ids = routing({e: 1 + e % 3 for e in range(8)})
    x = torch.randn(ids.shape[0], 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    wide = CpuFusedExperts(w13, w2, packed.onednn_min_rows, onednn_dtype(torch.bfloat16))
    assert torch.equal(kernels.fused_moe(x, layer, weights, ids), wide(x, weights, ids))
