"""Build a model and fill it from a Hugging Face folder (safetensors, sharded or not) or a GGUF file."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import time
from typing import Iterator, Optional

import torch
from tqdm.auto import tqdm

from engine.config import ConfigError
from engine.interfaces.layer_kernels import LayerKernels
from engine.interfaces.quantization import QuantizationMethod
from engine.model.layers.kernels import use_layer_kernels
from engine.model.layers.native_kernels import NativeLayerKernels
from engine.model.model_info import ModelInfo
from engine.plugins import get_plugin_manager

logger = logging.getLogger(__name__)


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def iterate_hf_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every safetensors shard of a Hugging Face folder."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    if not files:
        raise ConfigError(f"model.model: {folder} holds no *.safetensors weights")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def count_checkpoint_tensors(info: ModelInfo) -> int:
    if info.format == "gguf":
        from engine.model.gguf_file import open_gguf

        return len(open_gguf(info.path).tensors)
    from safetensors import safe_open

    total = 0
    for path in _safetensors_files(info.path):
        with safe_open(path, framework="pt") as f:
            total += len(list(f.keys()))
    return total


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model_class(architecture: str) -> type:
    models = get_plugin_manager().models()
    if architecture not in models:
        raise ConfigError(f"model architecture '{architecture}' is not supported; supported: {models.architectures()}")
    return models.resolve(architecture)


def as_embedding_model(causal_cls: type) -> type:
    """A decoder family as an embedder: the stack without its LM head, loading checkpoints saved as the bare model
    (``Qwen3Model``: no ``model.`` prefix) or as the causal LM (its ``lm_head`` skipped)."""
    from engine.distributed.parallel_state import get_tp_group

    def __init__(self, config) -> None:
        torch.nn.Module.__init__(self)
        self.config = config
        self.model = self.model_cls(config, self.attention_cls)
        self.tie_word_embeddings = False
        self.lm_head = None
        self.tp = get_tp_group()
        self.logits_gemm = None

    def load_weights(self, weights):
        renamed = (
            (name if name.startswith("model.") else f"model.{name}", tensor)
            for name, tensor in weights
            if not name.startswith("lm_head.")
        )
        return causal_cls.load_weights(self, renamed)

    return type(
        f"{causal_cls.__name__}AsEmbedding",
        (causal_cls,),
        {"__init__": __init__, "load_weights": load_weights, "__doc__": as_embedding_model.__doc__},
    )


def load_model(
    info: ModelInfo,
    device: torch.device,
    show_progress: bool = True,
    layer_kernels: Optional[LayerKernels] = None,
    quantization: Optional[QuantizationMethod] = None,
) -> torch.nn.Module:
    """Instantiate the model for this rank, its layers calling ``layer_kernels`` (native torch ops by
    default), and load its weights, with a progress bar, stored as ``quantization`` says (float by default)."""
    start = time.perf_counter()
    model_cls = get_model_class(info.architecture)
    if info.pooling is not None and info.pooling.convert == "embed" and not info.pooling.encoder_only:
        model_cls = as_embedding_model(model_cls)
    layer_kernels = layer_kernels or NativeLayerKernels()
    with _default_dtype(info.dtype), torch.device(device), use_layer_kernels(layer_kernels):
        model = model_cls(info.hf_config)
    if info.format == "gguf":
        from engine.model.gguf_file import iterate_gguf_weights

        keep = quantization.packed_checkpoint_formats(info) if quantization is not None else frozenset()
        weights = iterate_gguf_weights(info.path, info.hf_config, keep)
    else:
        weights = iterate_hf_weights(info.path)
    total = count_checkpoint_tensors(info)
    bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False)
    with torch.no_grad():
        loaded = model.load_weights(bar)
    if not isinstance(loaded, (set, frozenset)):
        raise TypeError(
            f"{model_cls.__module__}.{model_cls.__qualname__}.load_weights must return the set of "
            f"parameter names it loaded, got {type(loaded).__name__}"
        )
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {info.path} lacks weights for: {sorted(missing)[:8]}")
    model.eval()
    num_parameters = sum(p.numel() for p in model.parameters())  # before packing releases any plain weight
    if quantization is not None:
        quantization.process_weights_after_loading(model)
    layer_kernels.process_weights_after_loading(model, info.dtype, device)
    logger.info(
        "Loaded %s (%s, %s) in %.1fs: %.1fM parameters on this rank",
        info.architecture,
        info.format,
        str(info.dtype).replace("torch.", ""),
        time.perf_counter() - start,
        num_parameters / 1e6,
    )
    return model
