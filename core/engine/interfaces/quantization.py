"""QuantizationMethod interface: how a model's linear weights are stored in memory.

A method decides which checkpoint tensors stay packed as they load (``packed_checkpoint_formats``) and turns the
loaded model's linear layers into quantized ones (``process_weights_after_loading`` sets ``module.quant_weight``,
an :class:`~engine.model.quant_formats.QuantizedWeight`). The products on those weights come from the layer
kernels (``LayerKernels.quantized_product_candidates``), chosen by measurement like the float ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.interfaces.base import Pluggable

if TYPE_CHECKING:
    from engine.model.model_info import ModelInfo


class QuantizationMethod(Pluggable):
    """A way of storing weights; chosen by ``model.quantization`` (``none``: float weights; ``gguf``: a GGUF file's
    blocks kept packed, what ``auto`` takes for a GGUF file under layer kernels that serve packed weights, ``none``
    otherwise; ``int8``: weight-only int8 made at load)."""

    def packed_checkpoint_formats(self, model_info: ModelInfo) -> frozenset[str]:
        """Formats (``engine.model.quant_formats.FORMATS``) of checkpoint tensors to load without
        de-quantizing them; others arrive as float tensors."""
        return frozenset()

    def process_weights_after_loading(self, model: torch.nn.Module) -> None:
        """Quantize or assemble the loaded linear weights (the loader calls it once, before the layer kernels
        prepare their products)."""
