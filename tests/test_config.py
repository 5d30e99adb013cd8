"""VllmConfig: precedence, flat keys, and errors that name the key and the choices."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, VllmConfig
from engine.entrypoints.cli import build_parser, config_from_args


def test_defaults(monkeypatch):
    monkeypatch.delenv("ENGINE_CACHE__KV_CACHE_MEMORY", raising=False)  # set for the suite by conftest
    config = VllmConfig.load()
    assert config.cache.kv_cache_memory == 2 * 1024**3
    assert config.cache.block_size == 16
    assert config.attention.backend == "auto"
    assert config.scheduler.max_num_batched_tokens == 2048


def test_precedence_defaults_yaml_env_kwargs(tmp_path, monkeypatch):
    monkeypatch.delenv("ENGINE_CACHE__KV_CACHE_MEMORY", raising=False)
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "cache:\n  block_size: 32\n  kv_cache_memory: 1GiB\nscheduler:\n  max_num_seqs: 7\n"
        "attention:\n  backend: torch\n  options: {foo: 1}\n"
    )
    config = VllmConfig.load(path)
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.attention.backend) == (32, 7, "torch")
    assert config.cache.kv_cache_memory == 2**30 and config.attention.options == {"foo": 1}

    monkeypatch.setenv("ENGINE_SCHEDULER__MAX_NUM_SEQS", "9")
    monkeypatch.setenv("ENGINE_CACHE__BLOCK_SIZE", "64")
    config = VllmConfig.load(path)
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (64, 9)  # env beats YAML
    assert config.cache.kv_cache_memory == 2**30  # untouched YAML key survives

    config = VllmConfig.load(path, block_size=8, **{"scheduler.max_num_seqs": 3})
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (8, 3)  # kwargs beat env


def test_flat_aliases_choose_plugins():
    config = VllmConfig.load(attention="triton", executor="multiproc", sampler="mine")
    assert (config.attention.backend, config.parallel.executor, config.sampler.name) == ("triton", "multiproc", "mine")


def test_yaml_may_use_flat_keys(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("max_num_batched_tokens: 128\nattention: torch\n")
    config = VllmConfig.load(path)
    assert config.scheduler.max_num_batched_tokens == 128 and config.attention.backend == "torch"


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"max_num_batched_tokens": -5}, "scheduler.max_num_batched_tokens"),
        ({"block_size": 12}, "cache.block_size: Value error, must be one of (8, 16, 32, 64, 128, 256, 512)"),
        ({"dtype": "float8"}, "'float32', 'bfloat16'"),
        ({"kv_cache_memory": "lots"}, "cache.kv_cache_memory"),
        ({"not_a_key": 1}, "unknown config key 'not_a_key'"),
        ({"cache": {"blocksize": 16}}, "cache.blocksize: unknown key; valid keys here: ['block_size'"),
    ],
)
def test_bad_values_name_the_key_and_choices(kwargs, expected):
    with pytest.raises(ConfigError) as info:
        VllmConfig.load(**kwargs)
    assert expected in str(info.value)


def test_yaml_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("scheduler:\n  max_num_batched_tokes: 5\n")
    with pytest.raises(ConfigError, match="scheduler.max_num_batched_tokes: unknown key"):
        VllmConfig.load(path)


def test_cli_flags_override_the_file(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("cache:\n  block_size: 32\nattention:\n  backend: torch\n")
    args = build_parser().parse_args(
        [
            "plugins",
            "--config",
            str(path),
            "--block-size",
            "64",
            "--no-enable-prefix-caching",
            "--attention-options",
            '{"x": 2}',
        ]
    )
    config = config_from_args(args)
    assert config.cache.block_size == 64 and config.attention.backend == "torch"
    assert config.cache.enable_prefix_caching is False and config.attention.options == {"x": 2}


def test_cli_rejects_a_choice_outside_the_literal():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plugins", "--dtype", "float8"])


def test_config_reference_is_current():
    from pathlib import Path

    from engine.config_docs import render_config_markdown

    committed = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert committed == render_config_markdown(), (
        "docs/config.md is stale: run `engine config-docs --output docs/config.md`"
    )
