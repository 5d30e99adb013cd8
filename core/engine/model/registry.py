"""Built-in model families, registered through the ``engine_models`` hook."""
from __future__ import annotations

from engine.hookspecs import hookimpl
from engine.model.llama import LlamaForCausalLM


@hookimpl
def engine_models():
    return {"LlamaForCausalLM": LlamaForCausalLM}
