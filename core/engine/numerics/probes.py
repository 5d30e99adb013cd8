"""Probes: forward hooks at every layer boundary of a loaded model, and inside it (the attention core, the
attention or Mamba mixer, the MLP or MoE block), recording each one's output rows as float64."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MIXERS = ("self_attn", "mamba")  # a layer's token mixer, by the families' attribute names
FEED_FORWARDS = ("mlp", "feed_forward", "block_sparse_moe")


@dataclass
class Probe:
    """One probed op: its name (``layer3.mlp``), its place in the forward order, and what it recorded."""

    name: str
    layer: int
    op: str
    records: list[torch.Tensor] = field(default_factory=list)  # one per forward call


def _tensor_of(output: Any) -> torch.Tensor:
    """A module's output as one tensor: a layer's (MLP output, residual) pair is their sum, the layer's output;
    a norm's (normed, residual) pair its first."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot probe an output of type {type(output).__name__}")


def _layer_output(output: Any) -> torch.Tensor:
    if isinstance(output, (tuple, list)) and len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output):
        return output[0] + output[1] if output[1] is not None else output[0]
    return _tensor_of(output)


class ProbeSet:
    """Hooks on one model; ``arm()`` starts recording, ``close()`` removes them. Every probe records one tensor per
    forward call (float64, on the CPU)."""

    def __init__(self, model: nn.Module):
        self.probes: list[Probe] = []
        self._handles: list[Any] = []
        self.armed = False
        stack = getattr(model, "model", model)
        layers = getattr(stack, "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers to probe")
        for index, layer in enumerate(layers):
            if not any(hasattr(layer, name) for name in (*MIXERS, *FEED_FORWARDS)):
                continue  # a pipeline stage's missing layer
            mixer = next((getattr(layer, n) for n in MIXERS if hasattr(layer, n)), None)
            core = getattr(mixer, "attn", None) if mixer is not None else None
            if isinstance(core, nn.Module):
                self._add(core, index, "attention", _tensor_of)
            if mixer is not None:
                self._add(mixer, index, next(n for n in MIXERS if hasattr(layer, n)), _tensor_of)
            feed_forward = next((n for n in FEED_FORWARDS if hasattr(layer, n)), None)
            if feed_forward is not None:
                self._add(getattr(layer, feed_forward), index, feed_forward, _tensor_of)
            self._add(layer, index, "output", _layer_output)
        norm = getattr(stack, "norm", None)
        if isinstance(norm, nn.Module) and len(list(norm.parameters())):
            self._add(norm, len(layers), "final_norm", _tensor_of)

    def _add(self, module: nn.Module, layer: int, op: str, take) -> None:
        probe = Probe(f"layer{layer}.{op}" if op != "final_norm" else "final_norm", layer, op)

        def hook(_module, _inputs, output) -> None:
            if self.armed:
                probe.records.append(take(output).detach().to("cpu", torch.float64).clone())

        self._handles.append(module.register_forward_hook(hook))
        self.probes.append(probe)

    def arm(self) -> None:
        for probe in self.probes:
            probe.records.clear()
        self.armed = True

    def close(self) -> None:
        self.armed = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
