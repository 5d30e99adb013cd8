"""The `engine` command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def engine(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_text_and_logs_start_up(tiny_llama, tmp_path):
    config = tmp_path / "deploy.yaml"
    config.write_text("cache:\n  kv_cache_memory: 64MiB\n  block_size: 32\nscheduler:\n  max_num_seqs: 4\n")
    result = engine(
        "generate",
        "Hello there",
        "Bye now",
        "--model",
        tiny_llama,
        "--config",
        str(config),
        "--max-tokens",
        "5",
        "--json",
        "--dtype",
        "float32",
        "-v",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello there", "Bye now"]
    assert all(len(line["token_ids"]) == 5 and line["finish_reason"] == "length" for line in lines)
    log = result.stderr
    assert "'block_size': 32" in log and "'max_num_seqs': 4" in log  # config summary from the file
    assert re.search(r"plugin attention\s+(cpu|torch) ", log) and "plugin executor" in log  # cpu when built
    assert "KV cache:" in log and "blocks of 32 tokens" in log
    assert "Processed prompts" in log  # tqdm progress


def test_config_error_exits_2_with_the_key(tiny_llama):
    result = engine("generate", "hi", "--model", tiny_llama, "--attention", "nope")
    assert result.returncode == 2
    assert "attention.backend" in result.stderr and "'torch'" in result.stderr


def test_help_lists_config_flags():
    result = engine("generate", "--help")
    for flag in (
        "--attention",
        "--executor",
        "--sampler",
        "--block-size",
        "--max-num-batched-tokens",
        "--kv-cache-memory",
        "--enable-prefix-caching",
        "--config",
    ):
        assert flag in result.stdout
    # flags are spelt as the config keys users know: --attention, not the field name --backend; each once
    words = result.stdout.replace(",", " ").split()
    for field_name in ("--backend", "--name", "--options"):
        assert field_name not in words
    assert words.count("--executor") == 1 and words.count("--attention") == 1
