"""Transparent huge pages for the quantized weights a CPU decode step streams (engine.huge_pages): the arena's
placement, the advised mappings, their release, and the worker's weights placed there (``device.huge_pages``) with
the same tokens as without."""

from __future__ import annotations

import gc
import platform

import pytest
import torch

from engine import huge_pages
from engine.huge_pages import HUGE_PAGE, HugePageArena, huge_page_bytes, huge_pages_available, transparent_huge_pages

linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/smaps and madvise are Linux's")
needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this kernel offers no transparent huge pages")


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping that holds ``address``: its range, flags and huge-page bytes."""
    found, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
                if inside:
                    found = {"start": start, "end": end}
            elif inside and line.startswith("VmFlags:"):
                found["flags"] = set(line.split()[1:])
            elif inside and line.startswith("AnonHugePages:"):
                found["anon_huge_kib"] = int(line.split()[1])
    return found


def test_the_kernel_setting_is_read_from_its_brackets(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    settings = ("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"), ("[never]", "never")
    for text, mode in settings:
        setting.write_text(text)
        monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
        assert transparent_huge_pages() == mode
        assert huge_pages_available() == (mode != "never")
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert transparent_huge_pages() is None and not huge_pages_available()


def test_the_arena_keeps_values_shapes_and_dtypes_on_cache_lines_of_one_aligned_mapping():
    arena = HugePageArena(mapping_bytes=4 * HUGE_PAGE)
    tensors = [
        torch.arange(10, dtype=torch.uint8),
        torch.randn(3, 5),
        torch.randn(7, 2, dtype=torch.float64).t(),  # not contiguous: placed contiguous
        torch.randint(-100, 100, (33,), dtype=torch.int8),
        torch.randn(4, 4).to(torch.bfloat16),
    ]
    placed = [arena.place(t) for t in tensors]
    for source, copy in zip(tensors, placed):
        assert copy.dtype == source.dtype and copy.shape == source.shape and copy.is_contiguous()
        assert torch.equal(copy, source)
        assert copy.data_ptr() % 64 == 0
    first = placed[0].data_ptr()
    assert first % HUGE_PAGE == 0  # a fresh mapping starts on a huge page
    assert all(first <= p.data_ptr() < first + 4 * HUGE_PAGE for p in placed)  # one mapping, one after another
    assert placed[1].data_ptr() - first == 64  # 10 bytes, then the next cache line
    big = arena.place(torch.ones(5 * HUGE_PAGE, dtype=torch.uint8))  # larger than a mapping: one of its own
    assert big.data_ptr() % HUGE_PAGE == 0 and bool(big.all())


@linux_only
def test_an_advised_mapping_gets_huge_pages_and_goes_back_with_its_last_tensor():
    region = huge_page_bytes(8 * 2**20)
    assert region.numel() == 8 * 2**20 and region.data_ptr() % HUGE_PAGE == 0 and not bool(region.any())
    region.fill_(1)  # touched: the pages are mapped now
    entry = mapping_of(region.data_ptr())
    if huge_pages_available():
        assert "hg" in entry["flags"]  # MADV_HUGEPAGE
        assert entry["anon_huge_kib"] > 0, entry  # the kernel backed it with 2 MiB pages
    view = region[HUGE_PAGE:]
    address = region.data_ptr()
    del region
    gc.collect()
    assert mapping_of(address), "a view keeps the mapping"
    del view
    gc.collect()
    assert not mapping_of(address), "the mapping outlived its last tensor"


def test_with_the_policy_off_tensors_stay_where_torch_puts_them(monkeypatch):
    monkeypatch.setattr(huge_pages, "_enabled", False)
    weight = torch.randn(8, 8)
    assert huge_pages.in_huge_pages(weight) is weight


@linux_only
@needs_thp
def test_the_cpu_worker_streams_its_quantized_weights_from_huge_pages(tiny_llama):
    """With ``device.huge_pages`` (the default) the interleaved integer weights lie in the arena's advised mappings,
    the float GEMM's panels and the KV cache outside it; with it off none do; the tokens are the same bits either
    way."""
    pytest.importorskip("engine_attention_cpu._quant", reason="the cpu plugin's kernels are not built")
    from engine import LLM, SamplingParams
    from engine.testing import inspect
    from engine.testing.models import random_prompts
    from engine_attention_cpu.gemm import CpuPackedLinear
    from engine_attention_cpu.quant import QuantDotProduct

    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, (8, 30), seed=5, vocab=(100, 1000))]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    results = {}
    try:
        for enabled in (True, False):
            llm = LLM(
                model=tiny_llama,
                dtype="float32",
                layer_kernels="cpu",
                quantization="int8",
                kv_cache_memory="32MiB",
                huge_pages=enabled,
            )
            runner = inspect(llm).model_runner
            products = list(_products(inspect(llm).model))
            quantized = [p.data for p in products if isinstance(p, QuantDotProduct)]
            ordinary = [p.panels for p in products if isinstance(p, CpuPackedLinear)]  # the float LM head
            ordinary += [layer.kv_cache for layer in runner.attention_layers.values()]
            assert quantized and ordinary
            for tensor in quantized:
                assert in_arena(tensor) == enabled
                if enabled:
                    assert "hg" in mapping_of(tensor.data_ptr())["flags"]
            # (the heap's own pages may be advised too: numpy advises its large arrays, which the heap policy keeps
            # on the heap, so only the arena's placement is asserted for these)
            for tensor in ordinary:
                assert not in_arena(tensor)
            results[enabled] = llm.generate(prompts, params, use_tqdm=False)
            llm.shutdown()
    finally:
        huge_pages.apply_huge_page_policy(True)
    for on, off in zip(results[True], results[False]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in on.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in off.outputs[0].logprobs
        ]


def in_arena(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views an arena mapping (a region larger than itself) rather than storage of its own."""
    return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()


def _products(model: torch.nn.Module):
    """Every product the model's linear layers chose (each row bucket's, for bucketed ones)."""
    from engine.model.layers.product_choice import BucketedProduct

    for module in model.modules():
        product = getattr(module, "packed", None)
        if isinstance(product, BucketedProduct):
            yield from (p for _, p in product.products)
        elif product is not None:
            yield product
