"""Reading a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) and checking it against
the base model before any process loads it: a bad adapter is refused with the reason, never half-loaded."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

# the projections an adapter may target, by their checkpoint names (as PEFT's target_modules spell them)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")

_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>[a-z_]+)$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served here, and why (the front end answers 400; the engine keeps serving)."""


@dataclass(frozen=True)
class ModuleShape:
    """A projection's full (unsharded) input and output features."""

    in_features: int
    out_features: int


def lora_target_shapes(hf_config: Any) -> dict[str, ModuleShape]:
    """The projections of a dense decoder layer (Llama, Mistral, Qwen2/3, Gemma) an adapter may target, with their
    shapes; an MoE model's experts are not among them."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    shapes = {
        "q_proj": ModuleShape(hidden, heads * head_dim),
        "k_proj": ModuleShape(hidden, kv_heads * head_dim),
        "v_proj": ModuleShape(hidden, kv_heads * head_dim),
        "o_proj": ModuleShape(heads * head_dim, hidden),
    }
    intermediate = getattr(hf_config, "intermediate_size", None)
    if (
        intermediate
        and not getattr(hf_config, "num_experts", None)
        and not getattr(hf_config, "num_local_experts", None)
    ):
        shapes.update(
            gate_proj=ModuleShape(hidden, intermediate),
            up_proj=ModuleShape(hidden, intermediate),
            down_proj=ModuleShape(intermediate, hidden),
        )
    return shapes


@dataclass
class AdapterModule:
    """One targeted projection of one layer: A ``[r, in]``, B ``[out, r]`` and the scaling of ``B A x``."""

    rank: int
    scaling: float
    lora_a: Optional[torch.Tensor] = None
    lora_b: Optional[torch.Tensor] = None


@dataclass
class PEFTAdapter:
    """An adapter folder read and checked: its modules by checkpoint name (``model.layers.3.self_attn.q_proj``)."""

    path: Path
    rank: int  # the highest rank of any module
    alpha: float
    use_rslora: bool
    target_modules: list[str]
    modules: dict[str, AdapterModule] = field(default_factory=dict)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name it ends (or fully matches as a regex)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
        try:
            if re.fullmatch(key, module):
                return value
        except re.error:
            continue
    return default


def _weights_file(folder: Path) -> Path:
    for name in WEIGHTS_FILES:
        if (folder / name).is_file():
            return folder / name
    raise LoRAAdapterError(f"LoRA adapter {folder} has no weights: expected {' or '.join(WEIGHTS_FILES)}")


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {folder} is not a folder")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {folder} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {config_path} does not parse: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {config_path} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"adapter {folder} is a {peft_type} adapter; only LORA adapters are served")
    for key, unsupported in (
        ("use_dora", "DoRA adapters are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers) is not supported"),
    ):
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {folder}: {unsupported}")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"LoRA adapter {folder}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"LoRA adapter {folder}: modules_to_save {config['modules_to_save']} (fully trained layers) are not "
            "supported; only LoRA projections are"
        )
    return config


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt") as f:
                return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as exc:  # a truncated or foreign file
            raise LoRAAdapterError(f"LoRA adapter weights {weights} do not read: {exc}") from None
    return {name: tuple(t.shape) for name, t in _load_bin(weights).items()}


def _load_bin(weights: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(str(weights), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise LoRAAdapterError(f"LoRA adapter weights {weights} do not read: {exc}") from None


def read_adapter(
    path: str | Path,
    shapes: dict[str, ModuleShape],
    num_layers: int,
    max_lora_rank: int,
    load_weights: bool = False,
) -> PEFTAdapter:
    """Read and check an adapter folder against the base model's projection ``shapes`` and layer count.

    Refuses (``LoRAAdapterError``) a missing folder or file, a module the model does not have or LoRA does not
    serve, a rank above ``max_lora_rank`` and a tensor whose shape does not fit; ``load_weights`` also reads the
    tensors (float32)."""
    folder = Path(path)
    config = _read_config(folder)
    weights_path = _weights_file(folder)
    tensor_shapes = _tensor_shapes(weights_path)
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    targets = config.get("target_modules") or []
    adapter = PEFTAdapter(folder, 0, alpha, use_rslora, [targets] if isinstance(targets, str) else list(targets))
    pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, shape in tensor_shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            if "lora_magnitude_vector" in name:
                raise LoRAAdapterError(f"LoRA adapter {folder}: DoRA adapters are not supported")
            if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
                raise LoRAAdapterError(
                    f"LoRA adapter {folder}: tensor '{name}' adapts the embeddings or the LM head; only the "
                    f"projections {', '.join(SUPPORTED_MODULES)} are supported"
                )
            raise LoRAAdapterError(f"LoRA adapter {folder}: tensor '{name}' is not a LoRA A or B weight")
        pairs.setdefault(match["module"], {})[match["which"]] = (name, shape)
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {folder} holds no LoRA weights")
    for module, tensors in sorted(pairs.items()):
        where = _LAYER_MODULE.match(module)
        proj = where["proj"] if where else module.rsplit(".", 1)[-1]
        if where is None or proj not in SUPPORTED_MODULES:
            raise LoRAAdapterError(
                f"LoRA adapter {folder}: target module '{module}' is not supported; LoRA applies to "
                f"{', '.join(SUPPORTED_MODULES)} of the decoder layers"
            )
        if proj not in shapes:
            raise LoRAAdapterError(
                f"LoRA adapter {folder}: target module '{module}': this model has no dense '{proj}' to adapt "
                f"(adaptable here: {', '.join(shapes)})"
            )
        layer = int(where["layer"])
        if layer >= num_layers:
            raise LoRAAdapterError(
                f"LoRA adapter {folder}: target module '{module}' is past the model's {num_layers} layers"
            )
        if set(tensors) != {"A", "B"}:
            missing = ({"A", "B"} - set(tensors)).pop()
            raise LoRAAdapterError(f"LoRA adapter {folder}: module '{module}' lacks its lora_{missing} weight")
        (_, a_shape), (_, b_shape) = tensors["A"], tensors["B"]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        expected = shapes[proj]
        if a_shape != (rank, expected.in_features) or b_shape != (expected.out_features, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {folder}: module '{module}' has lora_A {list(a_shape)} and lora_B {list(b_shape)}, "
                f"which do not fit this model's {proj} ({expected.in_features} -> {expected.out_features}): expected "
                f"lora_A [r, {expected.in_features}] and lora_B [{expected.out_features}, r]"
            )
        if rank > max_lora_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {folder}: rank {rank} of '{module}' is above lora.max_lora_rank ({max_lora_rank}); "
                "raise --max-lora-rank to serve it"
            )
        module_alpha = float(_pattern_value(alpha_pattern, module, alpha))
        declared_rank = int(_pattern_value(rank_pattern, module, config.get("r", rank)))
        if declared_rank != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {folder}: module '{module}' has rank {rank} but its config says r={declared_rank}"
            )
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        adapter.modules[module] = AdapterModule(rank, scaling)
        adapter.rank = max(adapter.rank, rank)
    if load_weights:
        _load_tensors(adapter, weights_path, pairs)
    return adapter


def _load_tensors(adapter: PEFTAdapter, weights: Path, pairs: dict[str, dict[str, tuple[str, Any]]]) -> None:
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(weights))
    else:
        tensors = _load_bin(weights)
    for module, entry in adapter.modules.items():
        entry.lora_a = tensors[pairs[module]["A"][0]].float()
        entry.lora_b = tensors[pairs[module]["B"][0]].float()
