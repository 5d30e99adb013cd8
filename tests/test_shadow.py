"""Shadow A/B: `engine serve --shadow KEY=VALUE,...` re-runs a sample of live requests on a second engine core,
teacher-forced on the primary's tokens. Correct overrides must read equivalent, subtly wrong plugins (a softmax
scale 1% off, products rounded to bfloat16, an attention that raises on one request in 50) must be flagged, and
nothing of the shadow may reach or hurt the primary's clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import threading

import httpx
import pytest

from engine.config import ConfigError, VllmConfig
from engine.outputs import Logprob
from engine.shadow.compare import ShadowComparison, wilson_interval
from engine.shadow.tolerance import TOLERANCES, tolerance_for
from tests.helpers import Server, alive, install_fixture_plugins, wait_until

# ---- the comparison -------------------------------------------------------------------------------


def position(chosen: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """A position's log-probabilities as the engine gives them: the chosen token first, then the top ones."""
    ranks = {token: rank for rank, (token, _) in enumerate(top, 1)}
    values = dict(top)
    entries = {chosen: Logprob(values.get(chosen, -9.0), ranks.get(chosen, 99))}
    for token, value in top:
        entries.setdefault(token, Logprob(value, ranks[token]))
    return entries


def test_identical_distributions_are_equivalent_and_near_ties_do_not_count():
    comparison = ShadowComparison(TOLERANCES["float32"])
    primary = [position(5, [(5, -0.1), (6, -2.5)]), position(7, [(7, -0.6931), (8, -0.6932)])]
    # the second position is a near-tie (margin 1e-4 < float32's 1e-3): the shadow may order it either way
    shadow = [position(5, [(5, -0.1), (6, -2.5)]), position(7, [(8, -0.69315), (7, -0.69316)])]
    comparison.add_tokens("r", [5, 7], primary, shadow)
    assert comparison.tokens_compared == 2
    assert comparison.near_tie_disagreements == 1 and comparison.counted_disagreements == 0
    assert comparison.numerics_verdict() == "equivalent"


def test_a_flip_beyond_the_margin_diverges_and_names_the_position():
    comparison = ShadowComparison(TOLERANCES["float32"])
    primary = [position(5, [(5, -0.1), (6, -2.5)]), position(3, [(4, -0.2), (3, -1.9)])]
    shadow = [position(5, [(5, -0.1), (6, -2.5)]), position(3, [(3, -0.5), (4, -1.0)])]
    comparison.add_tokens("req-9", [5, 3], primary, shadow)
    report = comparison.report()
    assert report["verdict"] == "diverges"
    divergence = report["first_divergence"]
    assert (divergence["request_id"], divergence["position"]) == ("req-9", 1)
    assert (divergence["primary_token"], divergence["shadow_token"]) == (4, 3)
    assert divergence["primary_margin"] == pytest.approx(1.7)


def test_a_systematic_logprob_shift_diverges_even_when_every_top_token_agrees():
    shifted, exact = ShadowComparison(TOLERANCES["float32"]), ShadowComparison(TOLERANCES["float32"])
    for index in range(40):
        lp = -0.2 - 0.01 * index
        primary = [position(1, [(1, lp), (2, lp - 3)])]
        shifted.add_tokens(f"r{index}", [1], primary, [position(1, [(1, lp - 0.01), (2, lp - 3)])])
        exact.add_tokens(f"r{index}", [1], primary, [position(1, [(1, lp + 1e-6 * (-1) ** index), (2, lp - 3)])])
    assert shifted.counted_disagreements == 0 and shifted.numerics_verdict() == "diverges"
    assert shifted.report()["logprob_delta"]["ci95"] == pytest.approx([-0.01, -0.01], abs=1e-9)
    assert exact.numerics_verdict() == "equivalent"


def test_speed_verdict_from_the_tpot_ratio_interval_and_contended_pairs_left_out():
    slower = ShadowComparison(TOLERANCES["float32"])
    for index in range(10):
        slower.add_latency(0.010, 0.020 + 0.001 * (index % 3), contended=False)
    slower.add_latency(0.010, 0.001, contended=True)  # both engines worked at once: not in the ratio
    report = slower.report()["tpot_ratio"]
    assert slower.speed_verdict() == "slower" and report["pairs"] == 10 and report["contended_pairs"] == 1
    assert report["ci95"][0] < report["geometric_mean"] < report["ci95"][1]
    assert 2.0 < report["geometric_mean"] < 2.2
    same = ShadowComparison(TOLERANCES["float32"])
    for index in range(10):
        same.add_latency(0.010, 0.010 * (1.05 if index % 2 else 0.95), contended=False)
    assert same.speed_verdict() == "same speed"
    assert ShadowComparison(TOLERANCES["float32"]).speed_verdict() == "no data"


def test_errors_fail_the_verdict_and_tolerances_take_the_looser_dtype():
    comparison = ShadowComparison(TOLERANCES["float32"])
    comparison.add_error("request 3: RuntimeError: boom")
    assert comparison.numerics_verdict() == "fails"
    assert tolerance_for("float32", "bfloat16") is TOLERANCES["bfloat16"]
    assert tolerance_for("torch.float32") is TOLERANCES["float32"]
    with pytest.raises(ValueError, match="float64"):
        tolerance_for("float64")
    low, high = wilson_interval(0, 50)
    assert low == 0.0 and 0.05 < high < 0.1
    assert wilson_interval(50, 50)[1] == 1.0 and not math.isnan(wilson_interval(25, 50)[0])


# ---- config ---------------------------------------------------------------------------------------


def test_shadow_config_flag_json_and_yaml(tmp_path):
    config = VllmConfig.load(shadow="attention=torch, dtype=bfloat16", shadow_fraction=0.25)
    assert config.shadow.override_map() == {"attention": "torch", "dtype": "bfloat16"}
    shadow = config.shadow_config()
    assert shadow.attention.backend == "torch" and shadow.model.dtype == "bfloat16"
    assert shadow.device.niceness == 10 and shadow.cache.kv_cache_memory == 512 * 1024**2
    assert config.attention.backend == "auto" and config.device.niceness == 0  # the primary is untouched
    assert VllmConfig.load(shadow='{"cache": {"block_size": 32}}').shadow_config().cache.block_size == 32
    path = tmp_path / "engine.yaml"
    path.write_text("shadow:\n  overrides: {layer_kernels: native}\n  fraction: 1.0\n  schedule: concurrent\n")
    from_yaml = VllmConfig.load(path)
    assert from_yaml.shadow.enabled and from_yaml.shadow_config().device.layer_kernels == "native"
    assert not VllmConfig.load().shadow.enabled


@pytest.mark.parametrize(
    "overrides, extra, words",
    [
        ("attention", {}, "KEY=VALUE"),
        ("no_such_key=1", {}, "unknown config key 'no_such_key'"),
        ("port=9000", {}, "cannot set 'server.*'"),
        ("dtype=float8", {}, "shadow.overrides make an invalid shadow config: model.dtype"),
        ("attention=torch", {"api_server_count": 2}, "server.api_server_count=1"),
        ("attention=torch", {"shadow_schedule": "sometimes"}, "shadow.schedule"),
    ],
)
def test_bad_shadow_config_names_the_key(overrides, extra, words):
    with pytest.raises(ConfigError, match=words.replace("*", r"\*").replace("(", r"\(")):
        VllmConfig.load(shadow=overrides, **extra)


# ---- end to end -----------------------------------------------------------------------------------

SERVE_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--shadow-fraction", "1")


@pytest.fixture(scope="module")
def skewed_env(tmp_path_factory) -> dict:
    return install_fixture_plugins(tmp_path_factory, "engine_skewed_plugin")


def complete(server: Server, prompt_ids: list[int], max_tokens: int = 12, **extra) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def shadow_report(server: Server) -> dict:
    response = httpx.get(server.url + "/v1/shadow", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def settled(server: Server, completed: int, timeout: float = 120) -> dict:
    """The report once the shadow has compared (or failed on) ``completed`` mirrored requests."""

    def done() -> bool:
        report = shadow_report(server)
        comparison = report["comparison"] or {}
        return report["state"] in ("failed", "dead", "stopped") or (
            report["requests"]["completed"] + (comparison.get("errors") or {}).get("count", 0) >= completed
        )

    assert wait_until(done, timeout), shadow_report(server)
    return shadow_report(server)


PROMPTS = [[(7 * i + 3 * j) % 900 + 5 for j in range(9 + 4 * i)] for i in range(6)]


def test_a_correct_override_is_equivalent_and_the_client_sees_nothing_of_it(tiny_llama, tmp_path):
    server = Server("--model", tiny_llama, *SERVE_ARGS, "--shadow", "attention=torch,layer_kernels=native")
    try:
        plain = complete(server, PROMPTS[0])
        assert plain["choices"][0]["logprobs"] is None  # the forced top-2 never reaches the client
        one = complete(server, PROMPTS[1], logprobs=1)
        top = one["choices"][0]["logprobs"]["top_logprobs"]
        assert all(len(entry) == 1 for entry in top), top
        for prompt in PROMPTS[2:]:
            complete(server, prompt, temperature=0.8, seed=3)
        report = settled(server, len(PROMPTS))
        comparison = report["comparison"]
        assert report["state"] == "running" and report["verdict"] == "equivalent", report
        assert report["requests"]["mirrored"] == len(PROMPTS) and report["requests"]["dropped"] == 0
        assert comparison["tokens_compared"] == 12 * len(PROMPTS)
        assert comparison["top1_agreement"]["counted_disagreements"] == 0
        assert comparison["logprob_delta"]["mean_abs"] < TOLERANCES["float32"].logprob
        assert comparison["tpot_ratio"]["pairs"] + comparison["tpot_ratio"]["contended_pairs"] == len(PROMPTS)
        live = httpx.get(server.url + "/v1/engine/status", timeout=60).json()["shadow"]  # the console's live view
        assert live["verdict"] == "equivalent" and live["overrides"] == report["overrides"]
        metrics = httpx.get(server.url + "/metrics").text
        assert "engine_shadow_mirrored_total{model_name=" in metrics
        assert "engine_shadow_logprob_delta_bucket" in metrics and "engine_shadow_agreement" in metrics
        plot, saved = tmp_path / "shadow.png", tmp_path / "shadow.json"
        drawn = subprocess.run(
            [sys.executable, "-m", "engine.entrypoints.cli", "bench", "shadow-report", server.url]
            + ["--plot", str(plot), "--output", str(saved)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert drawn.returncode == 0, drawn.stderr
        assert json.loads(saved.read_text())["verdict"] == "equivalent" and plot.stat().st_size > 10_000
        # schedule=idle: while the primary works, the shadow's engine core is stopped; it runs again after
        with long_primary_request(server):
            assert wait_until(lambda: stopped_children(server), 60), "the shadow was not paused"
        assert wait_until(lambda: not stopped_children(server), 60)
    finally:
        server.stop()


def stopped_children(server: Server) -> list:
    import psutil

    stopped = []
    for proc in server.descendants():
        try:
            if proc.status() == psutil.STATUS_STOPPED:
                stopped.append(proc)
        except psutil.NoSuchProcess:
            pass
    return stopped


@contextlib.contextmanager
def long_primary_request(server: Server):
    """A primary request in flight (a long stream) for the duration of the block."""
    done = threading.Event()

    def run() -> None:
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
                for _ in response.iter_lines():
                    if done.is_set():
                        break
        except httpx.HTTPError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(60)


@pytest.mark.parametrize(
    "override",
    ["attention=skewed_scale", "layer_kernels=bf16_round"],
    ids=["softmax-scale-1pct", "bf16-accumulation"],
)
def test_a_subtly_wrong_plugin_diverges(tiny_llama, skewed_env, override):
    server = Server("--model", tiny_llama, *SERVE_ARGS, "--shadow", override, env=skewed_env)
    try:
        for prompt in PROMPTS:
            complete(server, prompt, max_tokens=16)
        report = settled(server, len(PROMPTS))
        assert report["verdict"] == "diverges", report
        comparison = report["comparison"]
        low, _ = comparison["logprob_delta"]["mean_abs_ci95"]
        assert comparison["top1_agreement"]["counted_disagreements"] > 0 or low > TOLERANCES["float32"].logprob
    finally:
        server.stop()


def test_a_shadow_that_raises_is_reported_and_drops_are_counted_while_the_primary_serves(tiny_llama, skewed_env):
    server = Server(
        "--model", tiny_llama, *SERVE_ARGS, "--shadow", "attention=flaky", "--shadow-max-queue", "2", env=skewed_env
    )
    try:
        # prompt + output of 50 tokens: the shadow's teacher-forced step raises; the other requests pass
        flaky = [[11 + j for j in range(38)], [20 + j for j in range(30)]]
        for prompt in flaky:
            assert len(complete(server, prompt)["choices"][0]["text"]) >= 0
        settled(server, len(flaky))

        async def burst() -> list[int]:  # more finished requests at once than the shadow's queue holds
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"max_tokens": 8, "temperature": 0.0}
                calls = [client.post(server.url + "/v1/completions", json={**body, "prompt": p}) for p in PROMPTS * 2]
                return [r.status_code for r in await asyncio.gather(*calls)]

        assert asyncio.run(burst()) == [200] * len(PROMPTS) * 2  # the primary answers everything
        report = settled(server, 2 + 2)
        assert report["verdict"] == "fails" and report["state"] == "running", report
        errors = report["comparison"]["errors"]
        assert errors["count"] == 1 and "flaky attention" in errors["first"], errors
        assert report["requests"]["dropped"] > 0
        counts = report["requests"]
        assert counts["mirrored"] + counts["dropped"] == len(flaky) + len(PROMPTS) * 2
        assert httpx.get(server.url + "/health").status_code == 200
        # a server killed outright while its shadow is stopped leaves no process behind
        with long_primary_request(server):
            assert wait_until(lambda: stopped_children(server), 60), "the shadow was not paused"
            children = server.descendants()
            server.proc.kill()
            server.proc.wait(10)
            assert wait_until(lambda: not alive(children), 60), alive(children)
    finally:
        server.stop()
