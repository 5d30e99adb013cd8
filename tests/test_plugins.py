"""The plugin contract: built-ins through the same hooks, entry points, selection and its errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine import LLM
from engine.config import ConfigError, VllmConfig
from engine.interfaces.base import SelectionContext
from engine.plugins import PluginManager
from tests.helpers import hf_greedy


def run_engine_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_plugins_table_lists_every_builtin():
    result = run_engine_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)}
    for key in [
        ("attention", "torch"),
        ("executor", "uniproc"),
        ("kv_cache_coordinator", "no_prefix"),
        ("kv_cache_coordinator", "unitary"),
        ("sampler", "default"),
        ("logits_processor", "min_tokens"),
    ]:
        assert key in rows and rows[key]["available"] == "yes", rows
    assert rows[("executor", "uniproc")]["source"].startswith("engine-executor-uniproc")
    assert rows[("attention", "torch")]["source"] == "engine (built-in)"


def test_each_kind_is_declared_once_and_drives_config_selection_and_listing():
    """The kind table in hookspecs is what the config fields, the flags, selection and `engine plugins` read."""
    from engine import hookspecs
    from engine.config import SECTIONS, flat_key_index
    from engine.plugins import get_plugin_manager

    ctx = SelectionContext(VllmConfig.load())
    rows = get_plugin_manager().table(ctx)
    for kind in hookspecs.KINDS.values():
        assert hasattr(hookspecs, kind.hook) and getattr(hookspecs, kind.hook).__doc__  # the construction contract
        assert any(row["kind"] == kind.name for row in rows), kind.name  # every kind is listed, models included
        if kind.config_key:
            section, field = kind.config_key.split(".")
            assert SECTIONS[section].model_fields[field].description == kind.choice_help
            assert all(flat_key_index()[flag] == kind.config_key for flag in kind.flags)
            assert VllmConfig.load(**{kind.config_key: "x"}).get_key(kind.config_key) == "x"
    models = {row["name"]: row for row in rows if row["kind"] == "model"}
    assert models["LlamaForCausalLM"]["reason"] == "lazy (engine.model.llama:LlamaForCausalLM)"


def test_removed_hooks_and_wrong_base_classes_are_reported():
    import types

    from engine import hookimpl

    class NotASampler:
        name = "not_a_sampler"
        priority = 0

    module = types.ModuleType("old_plugin")
    module.engine_models = hookimpl(lambda: {"OldForCausalLM": object})
    module.engine_samplers = hookimpl(lambda: [NotASampler])
    manager = PluginManager(load_entry_points=False)
    manager._register(module, "old", "engine-old-plugin 1.0", "1.0")
    rows = {(r["kind"], r["name"]): r for r in manager.table(SelectionContext(VllmConfig.load()))}
    assert "engine_models ignored" in rows[("(ignored hook)", "old")]["reason"]
    assert ("model", "OldForCausalLM") not in rows
    assert rows[("sampler", "not_a_sampler")]["available"] == "no"
    assert "not a subclass of engine.interfaces.sampler.Sampler" in rows[("sampler", "not_a_sampler")]["reason"]


def test_unavailable_implementation_says_why():
    result = run_engine_cli("plugins", "--tensor-parallel-size", "2", "--json")
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)}
    assert rows[("executor", "uniproc")]["available"] == "no"
    assert "tensor_parallel_size=2" in rows[("executor", "uniproc")]["reason"]


def test_unknown_backend_fails_before_loading_weights(tiny_llama, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the config was checked")

    monkeypatch.setattr("engine.worker.model_runner.load_model", no_loading)
    with pytest.raises(ConfigError) as info:
        LLM(tiny_llama, attention="flashy")
    message = str(info.value)
    assert "attention.backend" in message and "'flashy'" in message and "'torch'" in message and "'auto'" in message


def test_wrong_executor_for_the_world_size(tiny_llama, monkeypatch):
    monkeypatch.setattr("engine.worker.model_runner.load_model", lambda *a, **k: pytest.fail("loaded weights"))
    with pytest.raises(
        ConfigError, match="parallel.executor: executor 'uniproc' cannot run here: tensor_parallel_size=2"
    ):
        LLM(tiny_llama, executor="uniproc", tensor_parallel_size=2)


def test_coordinator_choice_follows_prefix_caching(tiny_llama):
    from engine.engine_core.engine_core import select_plugins
    from engine.model.model_info import resolve_model

    info = resolve_model(VllmConfig.load(model=tiny_llama).model)
    assert select_plugins(VllmConfig.load(model=tiny_llama), info)["kv_cache_coordinator"].name == "unitary"
    off = VllmConfig.load(model=tiny_llama, enable_prefix_caching=False)
    assert select_plugins(off, info)["kv_cache_coordinator"].name == "no_prefix"


def test_selection_prefers_priority_and_skips_unavailable():
    manager = PluginManager(load_entry_points=False)
    ctx = SelectionContext(VllmConfig.load())
    assert manager.select("attention", "auto", ctx).name == "torch"
    assert manager.select("sampler", "auto", ctx).name == "default"
    with pytest.raises(ConfigError, match="no executor implementation can run here"):
        manager.select("executor", "auto", ctx)  # no entry points loaded: no executor at all


def test_third_party_plugins_are_listed_and_refused_by_contract(plugin_env):
    result = run_engine_cli("plugins", "--json", env=plugin_env)
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)}
    for kind, name in [
        ("attention", "toy_attention"),
        ("executor", "toy_executor"),
        ("kv_cache_coordinator", "toy_coordinator"),
        ("sampler", "toy_sampler"),
        ("logits_processor", "toy_force"),
    ]:
        assert rows[(kind, name)]["source"] == "engine-toy-plugin 0.3.1"
        assert rows[(kind, name)]["available"] == "yes"
    assert rows[("attention", "toy_unavailable")]["reason"] == "toy-kernels library not installed"
    refused = rows[("(refused)", "future")]
    assert "contract 2.0" in refused["reason"] and "engine-future-plugin 9.0.0" == refused["source"]
    assert ("attention", "future_attention") not in rows


def test_third_party_plugins_run_every_hook(plugin_env, tiny_llama, hf_tiny_llama, tmp_path):
    model_dir = tmp_path / "toy-model"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["ToyForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = [[300, 301, 302, 303, 304], [1000, 2000, 3000]]
    script = f"""
import json
from engine import LLM, SamplingParams
from engine_toy_plugin.plugin import CALLS
llm = LLM({str(model_dir)!r}, dtype="float32", attention="toy_attention", executor="toy_executor",
          sampler="toy_sampler", kv_cache_coordinator="toy_coordinator", attention_options={{"marker": 7}})
params = [SamplingParams(temperature=0, max_tokens=6, extra_args={{"toy_force": 777}}),
          SamplingParams(temperature=0, max_tokens=6)]
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params, use_tqdm=False)
seeded = SamplingParams(temperature=1.0, max_tokens=4, seed=5)
again = [llm.generate([{{"prompt_token_ids": {prompts[1]!r}}}], seeded, use_tqdm=False)[0].outputs[0].token_ids
         for _ in range(2)]
assert again[0] == again[1], again
print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "calls": dict(CALLS)}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=plugin_env, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"][0] == [777] * 6  # the processor acted on the request that asked for it...
    assert report["tokens"][1] == hf_greedy(hf_tiny_llama, prompts[1:], 6)[0]  # ...and only on it
    calls = report["calls"]
    assert calls["model"] == 1 and calls["executor"] == 1 and calls["attention_option"] == 7
    assert calls["attention"] > 0 and calls["sampler"] > 0 and calls["coordinator"] > 0
    assert calls["force_rows"] == 6
    assert calls["generators"] == 8  # the seeded request's 4 steps, twice, through the 1.2 sampler view
    # contract 1.1 processors and samplers run through adapters, with one deprecation warning naming each
    for kind, name in [("logits_processor", "toy_force"), ("sampler", "toy_sampler")]:
        warnings = [line for line in result.stderr.splitlines() if f"{kind} '{name}' from engine-toy-plugin" in line]
        assert len(warnings) == 1 and "contract 1.1" in warnings[0], result.stderr
