"""Fixtures of the conformance kit: the implementation under test, a tiny random model and its reference."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run (slowly, exactly) on the CPU


def implementation(kind: str, name, **config):
    """The installed class named ``name`` of ``kind``; the test is skipped when no name was given, and
    fails when the name is unknown or cannot run here (with the reasons)."""
    from engine.config import VllmConfig
    from engine.interfaces.base import SelectionContext
    from engine.plugins import get_plugin_manager

    if name is None:
        pytest.skip(f"no {kind} named (see python -m pytest --pyargs engine.testing.conformance --help)")
    impls = get_plugin_manager().implementations(kind)
    assert name in impls, f"no {kind} named {name!r} is installed; installed: {sorted(impls)}"
    reasons = impls[name].reasons(SelectionContext(VllmConfig.load(**config)))
    if reasons:
        pytest.skip(f"{kind} {name!r} cannot run here: {'; '.join(reasons)}")
    return impls[name]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from engine.testing.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("conformance") / "tiny-llama")


@pytest.fixture(scope="session")
def hf_tiny_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
