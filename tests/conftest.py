"""Fixtures: tiny random models written by transformers, the default SmolLM2 GGUF, references."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines the tests start (in this process and the servers and workers they launch) take a 512 MiB KV cache, not
# the 2 GiB default: zeroing it and making its blocks cost a third of a tiny engine's start-up, hundreds of times
# a run. Tests of sizes and precedence set or remove the variable themselves.
os.environ.setdefault("ENGINE_CACHE__KV_CACHE_MEMORY", "512MiB")
if not torch.cuda.is_available():
    # Triton binds its library functions to interpreter mode at import: set it before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from engine.model.model_info import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, smollm2_gguf) -> str:
    """SmolLM2's tokenizer as a Hugging Face folder, shared by the tiny models."""
    from engine.testing.models import tokenizer_folder

    return tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: a random tiny model of a transformers config class, saved as a HF folder (cached per settings)."""
    from engine.testing.models import make_tiny_model as make_model

    cache: dict = {}

    def make(config_cls_name: str = "LlamaConfig", max_shard_size: str | None = None, seed: int = 0, **overrides):
        key = (config_cls_name, max_shard_size, seed, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_model(
                tmp_path_factory.mktemp(config_cls_name.lower()),
                config_cls_name,
                seed,
                tokenizer_dir,
                max_shard_size,
                **overrides,
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_tiny_model) -> str:
    return make_tiny_model()


@pytest.fixture(scope="module")
def features_server(tiny_llama):
    """`engine serve` on the tiny model with what the client-feature tests use (issue 43): the Responses API's
    store, beam search, priority scheduling, the qwen3 reasoning parser and the hermes tool-call parser. One per
    module: a module that checks that no process outlives the engine must not see it."""
    from tests.helpers import tiny_server

    srv = tiny_server(
        tiny_llama, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--scheduling-policy", "priority"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def plugin_env(tmp_path_factory) -> dict:
    """The toy and future fixture plugin distributions pip-installed into a private folder on PYTHONPATH."""
    from tests.helpers import install_fixture_plugins

    return install_fixture_plugins(tmp_path_factory, "engine_toy_plugin", "engine_future_plugin")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The oracle fixture proposer installed as a third-party distribution, visible here and to worker processes."""
    from engine.plugins import get_plugin_manager
    from tests.helpers import install_fixture_plugins

    env = install_fixture_plugins(tmp_path_factory, "engine_oracle_plugin")
    patch = pytest.MonkeyPatch()
    patch.setenv("PYTHONPATH", env["PYTHONPATH"])
    patch.syspath_prepend(env["PYTHONPATH"].split(os.pathsep)[0])
    get_plugin_manager.cache_clear()
    yield tmp_path_factory.mktemp("oracle")
    patch.undo()
    get_plugin_manager.cache_clear()


def _resident_set_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module", autouse=True)
def release_module_memory(request):
    """After each module (its own fixtures are torn down first): collect garbage and hand the freed heap back to
    the system (glibc keeps freed arenas otherwise), so the one process of the suite stays small.
    ``ENGINE_TEST_MEMLOG=<file>`` appends each module's resident size after the release: a leak shows as growth
    from module to module (``test_a_shut_down_llm_is_collected_with_its_weights`` guards the known one).
    """
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    log_path = os.environ.get("ENGINE_TEST_MEMLOG")
    if log_path:
        with open(log_path, "a") as log:
            log.write(f"{_resident_set_bytes() / 2**30:.2f} GiB  {request.module.__name__}\n")
