"""engine: an LLM inference and serving engine shaped like vLLM's V1 engine, every part a plugin."""

import importlib.metadata

from engine.thread_policy import apply_default_wait_policy


def _installed_version() -> str:
    """The version of the installed ``engine`` distribution (pyproject.toml's), ``0+unknown`` from a bare tree."""
    try:
        return importlib.metadata.version("engine")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


apply_default_wait_policy()  # before anything loads torch's OpenMP: idle threads sleep instead of spinning

from engine.hookspecs import CONTRACT_VERSION, hookimpl  # noqa: E402
from engine.lora_request import LoRARequest  # noqa: E402
from engine.pooling_params import PoolingParams  # noqa: E402
from engine.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "BeamSearchParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "hookimpl",
    "CONTRACT_VERSION",
    "EngineDeadError",
    "EngineGenerateError",
    "EngineUnavailableError",
]
__version__ = _installed_version()


def __getattr__(name):  # LLM pulls in torch and transformers: import it on first use
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.frontend.async_llm import AsyncLLM

        return AsyncLLM
    if name == "BeamSearchParams":
        from engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name in ("EngineDeadError", "EngineGenerateError", "EngineUnavailableError"):
        from engine import errors

        return getattr(errors, name)
    raise AttributeError(name)
