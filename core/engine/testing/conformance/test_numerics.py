"""The numerics oracle (``engine check numerics``) on the plugin under test: its activations at every layer stay
within the float32 tolerance of float64 on the tiny model (or yours), its tokens agree beyond near-ties, and a
sampler's draws fit its distribution."""

from __future__ import annotations

import json

from engine.testing.conformance.conftest import implementation


def assert_passes(report: dict) -> None:
    summary = {k: report[k] for k in ("first_failure", "guilty")} | {"tokens": report["tokens"]["verdict"]}
    assert report["verdict"] == "pass", json.dumps(summary, indent=1)


def numerics(model: str, **overrides) -> dict:
    from engine.numerics.oracle import check_numerics

    return check_numerics(model, {"dtype": "float32", **overrides}, num_prompts=2, sampler_draws=50_000)


def test_attention_numerics(attention_name, tiny_model, model_path):
    implementation("attention", attention_name)
    assert_passes(numerics(model_path or tiny_model, attention=attention_name))


def test_layer_kernels_numerics(layer_kernels_name, tiny_model, model_path):
    implementation("layer_kernels", layer_kernels_name)
    assert_passes(numerics(model_path or tiny_model, layer_kernels=layer_kernels_name))


def test_sampler_fits_its_distribution(sampler_name):
    from engine.config import VllmConfig
    from engine.numerics.sampler_check import check_sampler

    implementation("sampler", sampler_name)
    report = check_sampler(VllmConfig.load(), sampler_name, draws=200_000)
    assert report["passes"], json.dumps(report["worst"], indent=1)
