"""Random adapters in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``) for a base model:
what ``engine bench --lora-adapters N`` serves, and what tests load beside adapters made by ``peft`` itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.lora.adapter import ATTENTION_PROJECTIONS, lora_target_shapes


def write_random_adapter(
    hf_config: Any,
    folder: str | Path,
    rank: int = 16,
    alpha: float = 32.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
    std: float = 0.05,
    use_rslora: bool = False,
) -> str:
    """Write an adapter of ``rank`` on ``target_modules`` of every layer, A and B drawn from N(0, std) with
    ``seed`` (B is not zero, so the adapter changes the model's outputs), and return its folder."""
    from safetensors.torch import save_file

    shapes = lora_target_shapes(hf_config)
    unknown = [m for m in target_modules if m not in shapes]
    if unknown:
        raise ValueError(f"this model has no {unknown} to adapt (adaptable: {list(shapes)})")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(hf_config.num_hidden_layers)):
        for proj in target_modules:
            block = "self_attn" if proj in ATTENTION_PROJECTIONS else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            shape = shapes[proj]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, shape.in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(shape.out_features, rank, generator=generator) * std
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_rslora": use_rslora,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": getattr(hf_config, "_name_or_path", "") or "",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return str(out)
