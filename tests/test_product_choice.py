"""Linear products chosen by measurement: the fastest candidate per shape and row bucket, the disk cache,
`engine bench kernels`, the workload bound, noisy neighbours."""

from __future__ import annotations

import json

import psutil
import pytest
import torch

from engine.model.layers import product_choice
from engine.model.layers.product_choice import (
    ROW_BUCKETS,
    SWITCH_MARGIN,
    BucketedProduct,
    ProductCandidate,
    ProductShape,
    bucketed_product,
    choose_products,
)
from tests.test_bench import engine, is_png


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


class Recorded:
    """x @ w.T, repeated ``slow_rows(rows)`` extra times (a slow kernel at those row counts); records calls."""

    def __init__(self, name, weight, calls, extra_work):
        self.name, self.weight, self.calls, self.extra_work = name, weight, calls, extra_work

    def __call__(self, x):
        self.calls.append(self.name)
        for _ in range(self.extra_work(x.shape[0])):
            x @ self.weight.T
        return x @ self.weight.T


def candidates(calls):
    # "small" is fast up to 8 rows and slow beyond; "large" the other way round
    return [
        ProductCandidate("small", lambda w, b: Recorded("small", w, calls, lambda rows: 0 if rows <= 8 else 30)),
        ProductCandidate("large", lambda w, b: Recorded("large", w, calls, lambda rows: 30 if rows <= 8 else 0)),
    ]


def test_the_fastest_candidate_wins_each_bucket_and_layers_dispatch_by_rows(cache_home):
    calls = []
    shape = ProductShape(96, 64)
    table = choose_products([shape], candidates(calls), torch.float32, torch.float32)
    assert table.source == "measured"
    choice = table.choices[shape.key]
    assert choice.chosen == {"single": "small", "decode": "large", "prompt": "large"}
    assert choice.gflops["single"]["small"] > choice.gflops["single"]["large"]
    product = bucketed_product(choice, {c.name: c for c in candidates(calls)}, torch.randn(96, 64), None)
    assert isinstance(product, BucketedProduct)
    calls.clear()
    for rows in (1, 8, 9, 64, 300):
        assert product(torch.randn(rows, 64)).shape == (rows, 96)
    assert calls == ["small", "small", "large", "large", "large"]


def test_the_first_candidate_stays_unless_another_is_clearly_faster():
    from engine.model.layers.product_choice import pick_fastest

    assert pick_fastest({"own": 1.0, "other": 1.0 / (1 + SWITCH_MARGIN / 2)}, preferred="own") == "own"  # noise
    assert pick_fastest({"own": 1.0, "other": 1.0 / (1 + 2 * SWITCH_MARGIN)}, preferred="own") == "other"
    assert pick_fastest({"own": 1.0, "other": 2.0}, preferred="own") == "own"


def test_one_candidate_everywhere_is_used_without_dispatch(cache_home):
    calls = []
    only = [candidates(calls)[1]]
    table = choose_products([ProductShape(32, 16)], only, torch.float32, torch.float32)
    assert set(table.choices["32x16"].chosen.values()) == {"large"}
    weight = torch.randn(32, 16)
    product = bucketed_product(table.choices["32x16"], {c.name: c for c in only}, weight, None)
    assert isinstance(product, Recorded) and product.weight is weight  # the candidate's own product, no wrapper
    calls.clear()
    for rows in (1, 9, 300):  # every bucket's row count runs it, and it computes x @ w.T
        x = torch.randn(rows, 16)
        torch.testing.assert_close(product(x), x @ weight.T)
    assert calls == ["large"] * 3


def test_the_choice_is_cached_on_disk_and_measured_again_on_request(cache_home, monkeypatch):
    calls = []
    shapes = [ProductShape(48, 32), ProductShape(1000, 32, is_head=True)]
    first = choose_products(shapes, candidates(calls), torch.float32, torch.float32)
    files = list((cache_home / "engine" / "products").glob("*.json"))
    assert len(files) == 1 and first.source == "measured"
    stored = json.loads(files[0].read_text())
    assert stored["key"]["cpu"] and stored["key"]["isa"] == torch.backends.cpu.get_cpu_capability()
    assert stored["key"]["threads"] == torch.get_num_threads() and stored["key"]["torch"] == torch.__version__
    assert "prompt" not in first.choices["1000x32 head"].gflops  # the head never runs a prompt chunk
    assert first.choices["1000x32 head"].chosen["prompt"] == first.choices["1000x32 head"].chosen["decode"]

    calls.clear()
    cached = choose_products(shapes, candidates(calls), torch.float32, torch.float32)
    assert cached.source == str(files[0]) and calls == []  # nothing timed
    assert {k: c.chosen for k, c in cached.choices.items()} == {k: c.chosen for k, c in first.choices.items()}

    again = choose_products(shapes, candidates(calls), torch.float32, torch.float32, use_cache=False)
    assert again.source == "measured" and calls
    # another CPU (or torch, or thread count) is another key: measured, not read
    monkeypatch.setattr(product_choice, "cpu_identity", lambda: {"cpu": "other", "isa": "AVX512", "flags": "0"})
    calls.clear()
    assert choose_products(shapes, candidates(calls), torch.float32, torch.float32).source == "measured"
    assert len(list((cache_home / "engine" / "products").glob("*.json"))) == 2


def test_a_rebuilt_kernel_is_measured_again(cache_home, tmp_path):
    """A candidate's build (a compiled module's size and time) is part of the cache key: the same names after a
    rebuild of the kernels are measured again, not read from the choice made for the old code."""
    module = tmp_path / "kernel.so"
    module.write_bytes(b"old build")
    build = product_choice.module_build(type("Module", (), {"__file__": str(module)}))
    calls = []
    shapes = [ProductShape(48, 32)]

    def built(build):
        return [ProductCandidate(c.name, c.make, build) for c in candidates(calls)]

    assert choose_products(shapes, built(build), torch.float32, torch.float32).source == "measured"
    assert choose_products(shapes, built(build), torch.float32, torch.float32).source != "measured"
    module.write_bytes(b"the new build")
    rebuilt = product_choice.module_build(type("Module", (), {"__file__": str(module)}))
    assert rebuilt != build
    calls.clear()
    assert choose_products(shapes, built(rebuilt), torch.float32, torch.float32).source == "measured" and calls


def test_a_corrupt_cache_file_is_measured_again(cache_home):
    shapes = [ProductShape(24, 16)]
    choose_products(shapes, candidates([]), torch.float32, torch.float32)
    (path,) = (cache_home / "engine" / "products").glob("*.json")
    path.write_text("{not json")
    assert choose_products(shapes, candidates([]), torch.float32, torch.float32).source == "measured"


class CacheModel:
    """What the caches hold, as the timing of the candidates below sees it: a candidate that writes a large output
    (the de-quantizing product writes its whole float weight) leaves dirty lines, and the next product run pays for
    writing them back; the flush (reading an array twice the cache) leaves the caches clean."""

    def __init__(self):
        self.dirty = False
        self.events = []


def dirtying_candidates(cache: CacheModel):
    def product(name, extra_work, dirties):
        def run(x, w):
            cache.events.append(name)
            for _ in range(extra_work + (40 if cache.dirty else 0)):  # the write-back of what was left dirty
                x @ w.T
            cache.dirty = dirties
            return x @ w.T

        return lambda w, b: lambda x: run(x, w)

    # as the cpu layer kernels list them: the widest integer kernel, then the AVX2 one, then the de-quantizing one
    return [
        ProductCandidate("widest", product("widest", 0, False)),
        ProductCandidate("avx2", product("avx2", 8, False)),
        ProductCandidate("dequant", product("dequant", 60, True)),
    ]


def test_each_candidate_of_a_large_shape_is_timed_from_the_same_caches(cache_home, monkeypatch):
    """Found on SmolLM2's Q8_0 LM head (49152 x 576, AVX-512): the widest kernel, listed first, was always timed right
    after the de-quantizing candidate had written 113 MB of floats, and lost to the AVX2 kernel (61 against 81
    GFLOP/s), though it is the faster one in a decode step (the logits 0.63-1.01 against 0.92-1.16 ms a step, three
    runs each). Each candidate's runs now start after a flush of the last-level cache, so none pays for what the one
    before it left there."""
    cache = CacheModel()
    original_flush = product_choice.CacheFlush.__call__

    def recorded_flush(self):
        original_flush(self)
        cache.events.append("flush")
        cache.dirty = False

    monkeypatch.setattr(product_choice.CacheFlush, "__call__", recorded_flush)
    monkeypatch.setattr(product_choice, "last_level_cache_bytes", lambda: 64 * 96 * 4 * 2)  # the 96 x 64 fills half
    large, small = ProductShape(96, 64), ProductShape(48, 64)
    assert product_choice.shape_fills_cache(large, 64 * 96 * 4 * 2)
    assert not product_choice.shape_fills_cache(small, 64 * 96 * 4 * 2)

    table = choose_products([large], dirtying_candidates(cache), torch.float32, torch.float32)
    assert table.choices[large.key].chosen["single"] == "widest"
    runs = [event for event in cache.events if event != "flush"]
    assert runs and set(runs) == {"widest", "avx2", "dequant"}
    # no candidate's runs follow another candidate's without a flush between them
    for before, after in zip(cache.events, cache.events[1:]):
        assert before == "flush" or after in ("flush", before), cache.events

    # the same measurement without the flushes shows what they prevent: the widest kernel, after the dirty writes
    # (of the previous bucket's de-quantizing runs, then of each round's), is timed as the slower one; one call a
    # timed run, as for a weight whose call takes most of the budget (the LM head's took a quarter of it)
    cache.events.clear()
    cache.dirty = True
    seconds = product_choice.time_candidates(
        {c.name: c.make(torch.randn(96, 64), None) for c in dirtying_candidates(cache)}, torch.randn(1, 64), budget_s=0
    )
    assert seconds["widest"] > seconds["avx2"]

    # a shape whose candidates fit in the cache many times over is timed without flushes (each costs milliseconds)
    cache.events.clear()
    choose_products([small], dirtying_candidates(cache), torch.float32, torch.float32)
    assert "flush" not in cache.events


def test_the_last_level_cache_size_is_read_from_sysfs(tmp_path):
    for index, (level, size) in enumerate([(1, "32K"), (1, "32K"), (2, "1024K"), (3, "32768K")]):
        entry = tmp_path / f"index{index}"
        entry.mkdir()
        (entry / "level").write_text(f"{level}\n")
        (entry / "size").write_text(f"{size}\n")
    assert product_choice.last_level_cache_bytes(str(tmp_path)) == 32 * 2**20
    (tmp_path / "index3" / "size").write_text("1M\n")  # the unit the kernel prints for some caches
    assert product_choice.last_level_cache_bytes(str(tmp_path)) == 2**20
    missing = str(tmp_path / "none")
    assert product_choice.last_level_cache_bytes(missing) == product_choice.FALLBACK_CACHE_BYTES


def test_a_candidate_that_cannot_run_here_is_left_out(cache_home):
    def refuses(weight, bias):
        raise RuntimeError("this CPU lacks the instructions")

    table = choose_products(
        [ProductShape(16, 16)], [ProductCandidate("refuses", refuses), *candidates([])], torch.float32, torch.float32
    )
    choice = table.choices["16x16"]
    # every bucket was measured, on the candidates that can run, and one of them was chosen
    assert set(choice.gflops) == {bucket.name for bucket in ROW_BUCKETS}
    assert all(set(rates) == {"small", "large"} and min(rates.values()) > 0 for rates in choice.gflops.values())
    assert set(choice.chosen) == {bucket.name for bucket in ROW_BUCKETS}
    assert set(choice.chosen.values()) <= {"small", "large"}


def test_loaded_models_use_the_measured_products_and_the_kernel_cache_flag(cache_home, tiny_llama, caplog):
    from engine import LLM, SamplingParams
    from engine.config import VllmConfig

    assert VllmConfig.load(device={"kernel_cache": False}).device.kernel_cache is False
    caplog.set_level("INFO", logger="engine.model.layers.product_choice")

    def load_and_generate(**kwargs) -> str:
        caplog.clear()
        llm = LLM(tiny_llama, dtype="float32", max_model_len=128, **kwargs)
        try:
            out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3
        finally:
            llm.shutdown()
        (line,) = [r.getMessage() for r in caplog.records if "chosen by measurement" in r.getMessage()]
        return line

    assert "measured in" in load_and_generate()
    assert "cached in" in load_and_generate()  # the second engine on this machine reads the first one's choice
    assert "measured in" in load_and_generate(kernel_cache=False)


def test_native_16bit_products_match_the_reference_where_the_cpu_has_them():
    from engine.model.layers.gemm import PackedHalfLinear, PlainProduct, cpu_has_half_gemm

    if not cpu_has_half_gemm(torch.bfloat16):
        pytest.skip(
            f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bfloat16 GEMM "
            "(AVX-512-BF16 / AMX / AVX-NE-CONVERT)"
        )
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        expected = (x.double() @ weight.double().T + bias.double()).bfloat16().float()
        for product in (PackedHalfLinear(weight, bias, torch.bfloat16), PlainProduct(weight, bias, torch.bfloat16)):
            out = product(x)
            assert out.dtype == torch.bfloat16
            assert (out.float() - expected).abs().max() <= expected.abs().max() * 2**-6


def test_cpu_gemm_gives_the_same_bits_whatever_the_threads():
    """Work stealing moves panels between threads, never a partial sum: every output has one owner."""
    pytest.importorskip("engine_attention_cpu._gemm")
    from engine_attention_cpu.gemm import CpuPackedLinear, cpu_gemm_available

    if not cpu_gemm_available():
        pytest.skip("the cpu plugin was built without AVX2")
    gen = torch.Generator().manual_seed(4)
    threads = torch.get_num_threads()
    for rows, n, k in ((1, 49, 70), (64, 3072, 576), (300, 576, 1536)):
        product = CpuPackedLinear(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))
        x = torch.randn(rows, k, generator=gen)
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(product(x))
        torch.set_num_threads(threads)
        assert all(torch.equal(results[0], r) for r in results[1:])


def test_bench_kernels_prints_and_writes_the_table(tiny_llama, tmp_path):
    out, plot = tmp_path / "k.json", tmp_path / "k.png"
    env_args = ("--model", tiny_llama, "--dtype", "float32", "--output", str(out), "--plot", str(plot))
    result = engine("bench", "kernels", *env_args, "--no-kernel-cache")
    assert result.returncode == 0, result.stderr
    assert "measured in" in result.stdout and "chosen" in result.stdout
    report = json.loads(out.read_text())
    assert report["key"]["isa"] == torch.backends.cpu.get_cpu_capability() and is_png(plot)
    rows = report["table"]
    assert {r["bucket"] for r in rows} == {b.name for b in ROW_BUCKETS}
    for row in rows:
        timed = {k[:-7] for k in row if k.endswith("_gflops")}
        best = max(row[t + "_gflops"] for t in timed)  # the chosen one, or the default within the margin of it
        assert row["chosen"] in timed and (row[row["chosen"] + "_gflops"] + 0.1) * (1 + SWITCH_MARGIN) >= best
    assert not any(r["shape"].endswith("head") and r["bucket"] == "prompt" for r in rows)
    again = engine("bench", "kernels", *env_args)
    assert again.returncode == 0 and "read from" in again.stdout  # the engine's cache, as a worker reads it


def test_workload_bound_counts_the_flops(tiny_llama):
    from engine_bench.kernels import measure_products, workload_bound

    report = measure_products({"model": {"model": tiny_llama, "dtype": "float32"}})
    hf = report.hf_config
    prompts, outputs = [10, 30], [4, 1]
    bound = workload_bound(report, prompts, outputs)
    hidden, inter, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    head_size = getattr(hf, "head_dim", None) or hidden // hf.num_attention_heads
    q, kv = hf.num_attention_heads * head_size, hf.num_key_value_heads * head_size
    per_token = 2 * layers * (hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden)
    pairs = 10 * 11 // 2 + 11 + 12 + 13 + 30 * 31 // 2  # causal prompt pairs, then each decode token's context
    attention = 4 * hf.num_attention_heads * head_size * pairs * layers
    # tokens through the layers: every prompt token and every output token but the last of each request
    expected = per_token * (40 + 3 + 0) + 2 * hf.vocab_size * hidden * 5 + attention
    assert bound["workload_flop"] == expected and bound["attention_flop"] == attention
    assert bound["bound_tokens_per_s"] == pytest.approx(45 / bound["bound_seconds"], rel=1e-2)
    assert bound["best_gflops"] > 0


def test_noisy_neighbours_run_during_the_block_and_end_with_it():
    from engine_bench.neighbours import noisy_neighbours

    with pytest.raises(KeyboardInterrupt):
        with noisy_neighbours(2) as procs:
            assert len(procs) == 2 and all(psutil.Process(p.pid).is_running() for p in procs)
            raise KeyboardInterrupt
    assert all(p.poll() is not None for p in procs)
