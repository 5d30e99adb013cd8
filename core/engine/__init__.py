"""engine: an LLM inference and serving engine shaped like vLLM's V1 engine, every part a plugin."""
from engine.hookspecs import CONTRACT_VERSION, hookimpl
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "hookimpl", "CONTRACT_VERSION", "EngineDeadError",
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
