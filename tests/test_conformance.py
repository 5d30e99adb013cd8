"""The conformance kit (engine.testing.conformance) run as plugin authors run it: against the built-in
plugins (attention is checked by test_attention_backends.py with the kit's own checks) and against the
third-party fixture plugin, contract 1.1 processors and samplers included (through their adapters)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import install_fixture_plugins

BUILTIN_PROCESSORS = ["allowed_token_ids", "bad_words", "logit_bias", "min_tokens", "penalties", "min_p"]


def run_kit(*options: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "engine.testing.conformance",
            *options,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )


def passed_and_skipped(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_the_kit_passes_on_the_builtin_plugins(tiny_llama):
    options = [
        "--engine-sampler",
        "default",
        "--engine-executor",
        "uniproc",
        "--engine-executor",
        "multiproc",
        "--engine-kv-cache-coordinator",
        "unitary",
        "--engine-kv-cache-coordinator",
        "no_prefix",
        "--engine-layer-kernels",
        "native",
        "--engine-layer-kernels",
        "cpu",
        "--engine-model",
        tiny_llama,
        "--engine-quantization",
        "int8",
        "--engine-quantization",
        "none",
        "--engine-proposer",
        "ngram",
        "--engine-proposer",
        "suffix",
    ]
    for name in BUILTIN_PROCESSORS:
        options += ["--engine-logits-processor", name]
    summary = passed_and_skipped(run_kit(*options))
    assert "failed" not in summary and " passed" in summary, summary


def test_the_kit_passes_on_a_third_party_plugin(plugin_env):
    summary = passed_and_skipped(
        run_kit(
            "--engine-attention",
            "toy_attention",
            "--engine-sampler",
            "toy_sampler",
            "--engine-logits-processor",
            "toy_force",
            "--engine-logits-processor-params",
            json.dumps({"extra_args": {"toy_force": 5}}),
            "--engine-executor",
            "toy_executor",
            "--engine-kv-cache-coordinator",
            "toy_coordinator",
            env=plugin_env,
        )
    )
    assert "failed" not in summary and " passed" in summary, summary


def test_the_kit_fails_a_plugin_that_breaks_the_contract(tmp_path_factory):
    """A sampler that ignores temperature and a processor that touches every row: the kit says so."""
    env = install_fixture_plugins(tmp_path_factory, "engine_broken_plugin")
    result = run_kit(
        "--engine-sampler",
        "argmax_only",
        "--engine-logits-processor",
        "every_row",
        "--engine-logits-processor-params",
        json.dumps({"extra_args": {"every_row": True}}),
        env=env,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert any("test_samples_the_tempered_distribution" in line for line in failed), result.stdout[-3000:]
    assert any("test_changes_only_the_rows_that_asked" in line for line in failed), result.stdout[-3000:]
