"""`engine check numerics`: the built-in paths pass against float64 of the same weights, and each subtly wrong
plugin (a softmax scale 1% off, products rounded to bfloat16, a sampler that moves 1% of the mass) is named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.numerics.oracle import check_numerics
from engine.numerics.sampler_check import expected_probabilities, g_test
from engine.numerics.tolerance import activation_tolerance
from tests.helpers import install_fixture_plugins


@pytest.fixture(scope="module")
def skewed_env(tmp_path_factory) -> dict:
    return install_fixture_plugins(tmp_path_factory, "engine_skewed_plugin")


def test_the_built_in_paths_pass_and_every_probe_is_within_the_table(tiny_llama):
    report = check_numerics(tiny_llama, {"dtype": "float32"}, num_prompts=2, sampler_draws=100_000)
    assert report["verdict"] == "pass", json.dumps({k: report[k] for k in ("first_failure", "tokens", "guilty")})
    assert report["reference"]["dtype"] == "float64" and report["reference"]["plugins"]["attention"] == "torch"
    # the float64 reference against transformers' float64 forward, which keeps RMSNorm and RoPE in float32: their
    # float32 roundings, far under the float32 bound
    assert report["reference"]["transformers"]["max_relative_error"] < 2e-6, report["reference"]["transformers"]
    names = [row["name"] for row in report["probes"]]
    assert names[:4] == ["layer0.attention", "layer0.self_attn", "layer0.mlp", "layer0.output"] and names[-1] == (
        "final_norm"
    )
    # float32 against float64: not the same bits, and within the table at every depth
    assert all(0 < row["relative_error"] < row["tolerance"] for row in report["probes"])
    assert report["probes"][0]["tolerance"] == activation_tolerance("float32", 0) < report["probes"][-1]["tolerance"]
    assert report["tokens"]["tokens_compared"] > 50 and report["tokens"]["top1_agreement"]["counted_disagreements"] == 0
    assert report["sampler"]["passes"] and report["guilty"] == [] and report["bisect"] == []


def run_check(model: str, env: dict, tmp_path, *flags: str, draws: int = 200_000) -> tuple[int, dict, str]:
    out, plot = tmp_path / "report.json", tmp_path / "errors.png"
    done = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "check", "numerics", model, "--dtype", "float32"]
        + ["--prompts", "2", "--sampler-draws", str(draws), "--output", str(out), "--plot", str(plot), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), done.stderr[-3000:]
    assert plot.stat().st_size > 10_000
    return done.returncode, json.loads(out.read_text()), done.stderr


def test_a_skewed_softmax_and_a_shifted_sampler_are_each_named(tiny_llama, skewed_env, tmp_path):
    code, report, stderr = run_check(
        tiny_llama, skewed_env, tmp_path, "--attention", "skewed_scale", "--sampler", "mass_shift"
    )
    assert code == 1 and report["verdict"] == "fail", stderr[-2000:]
    assert report["first_failure"]["name"] == "layer0.attention"  # the first op the scale touches
    guilty = {(g["kind"], g["plugin"]) for g in report["guilty"]}
    assert guilty == {("attention", "skewed_scale"), ("sampler", "mass_shift")}, report["bisect"]
    swap = next(b for b in report["bisect"] if b["kind"] == "attention")
    assert swap["fixes"] and swap["swapped_to"] == "torch" and swap["first_failure"] is None
    assert report["sampler"]["worst"]["p_value"] < 1e-6
    assert "guilty: attention=skewed_scale, sampler=mass_shift" in stderr


def test_products_rounded_to_bfloat16_are_named_and_not_the_attention(tiny_llama, skewed_env, tmp_path):
    # the built-in sampler is not under test here: a few draws keep its check short
    code, report, _ = run_check(tiny_llama, skewed_env, tmp_path, "--layer-kernels", "bf16_round", draws=20_000)
    assert code == 1 and report["sampler"]["passes"]
    assert [(g["kind"], g["plugin"]) for g in report["guilty"]] == [("layer_kernels", "bf16_round")]
    assert report["first_failure"]["name"] in ("layer0.attention", "layer0.self_attn")  # q/k/v, then o_proj
    assert report["first_failure"]["relative_error"] > 10 * report["first_failure"]["tolerance"]


def test_g_test_accepts_the_distribution_and_rejects_a_one_percent_shift():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] * 4)
    probs = expected_probabilities(logits, 1.0)
    torch.manual_seed(0)
    draws = 400_000
    fair = torch.bincount(torch.multinomial(probs, draws, replacement=True), minlength=len(probs)).double()
    assert g_test(fair, probs)[1] > 1e-6
    shifted = probs.clone()
    top = int(probs.argmax())
    shifted[top] -= 0.01
    shifted[(top + 1) % len(probs)] += 0.01
    skewed = torch.bincount(torch.multinomial(shifted, draws, replacement=True), minlength=len(probs)).double()
    assert g_test(skewed, probs)[1] < 1e-12
    # top-p keeps the smallest set that reaches the mass, top-k the k best
    assert int((expected_probabilities(logits, 1.0, top_k=3) > 0).sum()) == 3
    kept = expected_probabilities(logits, 1.0, top_p=0.5)
    assert 0 < int((kept > 0).sum()) < len(probs) and float(kept.sum()) == pytest.approx(1.0)
