"""What the engine knows about a pooling model before loading it: its tasks, default pooling, normalisation,
labels and whether its attention is bidirectional (read from config.json, sentence-transformers' modules.json and
the ``model.runner`` / ``model.convert`` / ``pooler`` settings)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from engine.config import ConfigError, ModelConfig, PoolerConfig

# bidirectional (encoder-only) families: every token attends to every other token of its request
ENCODER_ARCHITECTURE_PREFIXES = ("Bert", "Roberta", "XLMRoberta")
_POOLING_SUFFIXES = ("Model", "ForSequenceClassification")
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class PoolingInfo:
    """A pooling model's facts. ``tasks``: what requests it serves (``embed`` models also ``encode``; classifiers
    ``classify``, and ``score`` when they have one label); ``pooling_type``: the checkpoint's pooler (what
    ``pooler.pooling_type=auto`` picks); ``matryoshka``: False, True (any ``dimensions``) or the trained sizes."""

    convert: str  # "embed" or "classify"
    tasks: tuple[str, ...]
    pooling_type: str
    normalize: bool
    encoder_only: bool
    num_labels: int
    embedding_size: int
    matryoshka: Union[bool, list[int]] = False
    classifier_token_ids: Optional[list[int]] = None  # classifier_from_token, as ids of the model's vocabulary
    max_seq_length: Optional[int] = None  # sentence-transformers' limit (sentence_bert_config.json), as vLLM reads it


def is_encoder_architecture(architecture: str) -> bool:
    return architecture.startswith(ENCODER_ARCHITECTURE_PREFIXES)


def _read_json(path: str) -> Optional[Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sentence_transformers_modules(folder: str) -> Optional[list[dict[str, Any]]]:
    """The folder's sentence-transformers pipeline (modules.json), or None."""
    if not os.path.isdir(folder):
        return None
    modules = _read_json(os.path.join(folder, "modules.json"))
    return modules if isinstance(modules, list) else None


def _st_pooling_type(folder: str, modules: list[dict[str, Any]]) -> Optional[str]:
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config = _read_json(os.path.join(folder, module.get("path", ""), "config.json")) or {}
            for key, name in _ST_POOLING_MODES.items():
                if config.get(key):
                    return name
    return None


def runner_type(path: str, architecture: str, model_config: ModelConfig) -> str:
    """``generate`` or ``pooling``: ``model.runner``, or for ``auto`` what the checkpoint is."""
    if model_config.runner != "auto":
        return model_config.runner
    if architecture.endswith(_POOLING_SUFFIXES) or sentence_transformers_modules(path) is not None:
        return "pooling"
    return "generate"


def pooling_info(
    path: str, hf_config: Any, architecture: str, model_config: ModelConfig, pooler: PoolerConfig
) -> PoolingInfo:
    """The pooling facts of a model the ``pooling`` runner serves; ConfigError when it cannot be one."""
    encoder = is_encoder_architecture(architecture)
    classifier_arch = architecture.endswith("ForSequenceClassification")
    convert = model_config.convert
    if convert in ("auto", "none"):
        convert = "classify" if classifier_arch or pooler.classifier_from_token else "embed"
    num_labels = 0
    token_ids = None
    if convert == "classify":
        if pooler.classifier_from_token:
            if encoder or classifier_arch:
                raise ConfigError(
                    f"pooler.classifier_from_token applies to causal LMs; {architecture} has its own classifier"
                )
            token_ids = _token_ids(path, model_config, pooler.classifier_from_token)
            num_labels = 1  # two tokens: the positive one's logit minus the negative one's
        elif classifier_arch:
            num_labels = int(getattr(hf_config, "num_labels", 0) or len(getattr(hf_config, "id2label", {}) or {}) or 2)
        else:
            raise ConfigError(
                f"model.convert=classify: {architecture} has no classifier head; a causal LM becomes one through "
                "pooler.classifier_from_token (e.g. [no, yes] for Qwen3-Reranker)"
            )
    elif classifier_arch:
        raise ConfigError(f"model.convert={convert}: {architecture} is a classifier; use model.convert=classify")
    modules = sentence_transformers_modules(path)
    st_pooling = _st_pooling_type(path, modules) if modules else None
    default_pooling = st_pooling or ("cls" if encoder else "last")
    if pooler.normalize is not None:
        normalize = pooler.normalize
    elif modules is not None:
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    else:
        normalize = True
    matryoshka: Union[bool, list[int]] = False
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        matryoshka = sorted(int(d) for d in dims)
    elif getattr(hf_config, "is_matryoshka", False):
        matryoshka = True
    tasks = ("embed", "encode") if convert == "embed" else ("classify", "score") if num_labels == 1 else ("classify",)
    return PoolingInfo(
        convert=convert,
        tasks=tasks,
        pooling_type=default_pooling,
        normalize=normalize,
        encoder_only=encoder,
        num_labels=num_labels,
        embedding_size=int(hf_config.hidden_size),
        matryoshka=matryoshka,
        classifier_token_ids=token_ids,
        max_seq_length=_st_max_seq_length(path) if modules is not None else None,
    )


def _st_max_seq_length(folder: str) -> Optional[int]:
    config = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    value = config.get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def _token_ids(path: str, model_config: ModelConfig, tokens: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or path)
    ids = []
    for token in tokens:
        token_id: Any = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConfigError(f"pooler.classifier_from_token: {token!r} is not one token of this vocabulary")
            token_id = encoded[0]
        ids.append(int(token_id))
    return ids
