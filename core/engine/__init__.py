"""engine: an LLM inference and serving engine shaped like vLLM's V1 engine, every part a plugin."""
from engine.thread_policy import apply_default_wait_policy

apply_default_wait_policy()  # before anything loads torch's OpenMP: idle threads sleep instead of spinning

from engine.hookspecs import CONTRACT_VERSION, hookimpl  # noqa: E402
from engine.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "hookimpl", "CONTRACT_VERSION", "EngineDeadError",
           "EngineGenerateError"]
__version__ = "0.1.0"


def __getattr__(name):  # LLM pulls in torch and transformers: import it on first use
    if name == "LLM":
        from engine.runtime.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.runtime.async_llm import AsyncLLM

        return AsyncLLM
    if name in ("EngineDeadError", "EngineGenerateError"):
        from engine import errors

        return getattr(errors, name)
    raise AttributeError(name)
