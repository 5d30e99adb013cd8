"""The model registry: architecture names (config.json's ``architectures``) to model classes.

Families register through the ``register_models`` hook, the built-ins included, by class or by a lazy
``"package.module:ClassName"`` path that is imported only when a model of that architecture loads.
"""

from __future__ import annotations

import importlib
import logging
from typing import Union

from engine.hookspecs import hookimpl

logger = logging.getLogger(__name__)

ModelClassRef = Union[type, str]


class ModelRegistry:
    """Architecture name -> model class (or its lazy import path); a later registration overrides."""

    def __init__(self) -> None:
        self._models: dict[str, ModelClassRef] = {}
        self.sources: dict[str, str] = {}
        self._current_source = "engine"

    def register_model(self, architecture: str, model_cls: ModelClassRef) -> None:
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"model class path '{model_cls}' must look like 'package.module:ClassName'")
        if architecture in self._models and self.sources[architecture] != self._current_source:
            logger.info(
                "model %s from %s overrides the one from %s",
                architecture,
                self._current_source,
                self.sources[architecture],
            )
        self._models[architecture] = model_cls
        self.sources[architecture] = self._current_source

    def architectures(self) -> list[str]:
        return sorted(self._models)

    def reference(self, architecture: str) -> ModelClassRef:
        """The class, or its import path while it has not been imported."""
        return self._models[architecture]

    def __contains__(self, architecture: str) -> bool:
        return architecture in self._models

    def resolve(self, architecture: str) -> type:
        """The model class, importing it now if it was registered by path."""
        ref = self._models[architecture]
        if isinstance(ref, str):
            module_name, _, class_name = ref.partition(":")
            ref = getattr(importlib.import_module(module_name), class_name)
            self._models[architecture] = ref
        return ref


_BUILTIN = {
    "LlamaForCausalLM": "engine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.model.llama:LlamaForCausalLM",  # Llama with a sliding window
    "Qwen2ForCausalLM": "engine.model.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.model.qwen:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "engine.model.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "engine.model.gemma:Gemma3ForCausalLM",
    "MixtralForCausalLM": "engine.model.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "engine.model.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "engine.model.qwen_moe:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "engine.model.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "engine.model.deepseek_v2:DeepseekV3ForCausalLM",
    "BambaForCausalLM": "engine.model.bamba:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "engine.model.granite_moe_hybrid:GraniteMoeHybridForCausalLM",
    "JambaForCausalLM": "engine.model.jamba:JambaForCausalLM",
    # pooling models: decoder stacks saved without an LM head (embedders), and encoders
    "LlamaModel": "engine.model.llama:LlamaForCausalLM",
    "MistralModel": "engine.model.llama:LlamaForCausalLM",
    "Qwen2Model": "engine.model.qwen:Qwen2ForCausalLM",
    "Qwen3Model": "engine.model.qwen:Qwen3ForCausalLM",
    "BertModel": "engine.model.bert:BertModel",
    "BertForSequenceClassification": "engine.model.bert:BertForSequenceClassification",
    "RobertaModel": "engine.model.bert:XLMRobertaModel",
    "XLMRobertaModel": "engine.model.bert:XLMRobertaModel",
    "RobertaForSequenceClassification": "engine.model.bert:XLMRobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": "engine.model.bert:XLMRobertaForSequenceClassification",
}


@hookimpl
def register_models(registry: ModelRegistry) -> None:
    for architecture, path in _BUILTIN.items():
        registry.register_model(architecture, path)
