"""Quantized weight formats, kept packed in memory: GGUF's Q4_0, Q4_1 and Q8_0 blocks and weight-only int8.

Blocks run along a row (the input features), 32 weights each, as llama.cpp stores them:

- ``q4_0``: float16 scale ``d``, 16 bytes of nibbles (weight j in the low nibble of byte j, weight j + 16 in the high
  one); ``w = d * (q - 8)``. 18 bytes per 32 weights.
- ``q4_1``: float16 ``d`` and ``m``, the same nibbles; ``w = d * q + m``. 20 bytes.
- ``q8_0``: float16 ``d``, 32 signed bytes; ``w = d * q``. 34 bytes.
- ``int8``: one signed byte per weight with a float32 scale per output row (per channel), rows padded with zeros
  to a multiple of 32 so that the kernels read whole blocks.

``dequantize`` (torch ops) is the reference every kernel is tested against; ``quantize`` makes a format from a
float weight the way llama.cpp's reference quantizers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

QK = 32  # weights per block
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
FORMATS = ("q4_0", "q4_1", "q8_0", "int8")
GGUF_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGML type name -> format kept packed


@dataclass
class QuantizedWeight:
    """A weight ``[out_features, in_features]`` in a packed format: ``data`` holds one row of blocks per output row
    (uint8) or, for ``int8``, the int8 rows (padded to whole blocks) with ``scales`` per row."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor
    scales: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized format '{self.format}'; formats: {FORMATS}")
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        if self.shape[1] % QK and self.format != "int8":
            raise ValueError(f"{self.format} rows hold whole blocks of {QK}; in_features {self.shape[1]} is not one")

    # what a model's weight loader asks of a checkpoint tensor
    def to(self, *args, **kwargs) -> QuantizedWeight:
        return self

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (0 if self.scales is None else self.scales.nbytes)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) or whole blocks of columns (dim 1), as tensor-parallel shards take them."""
        if dim == 0:
            scales = None if self.scales is None else self.scales.narrow(0, start, length)
            return QuantizedWeight(self.format, (length, self.shape[1]), self.data.narrow(0, start, length), scales)
        if self.format == "int8":
            if start % QK:
                raise ValueError(f"int8 columns narrow on whole blocks of {QK}, not at {start}")
            data = self.data.narrow(1, start, length)
            if length % QK:
                data = torch.nn.functional.pad(data, (0, -length % QK))
            return QuantizedWeight("int8", (self.shape[0], length), data.contiguous(), self.scales)
        if start % QK or length % QK:
            raise ValueError(
                f"{self.format} columns narrow on whole blocks of {QK}: cannot take [{start}, {start + length})"
            )
        size = BLOCK_BYTES[self.format]
        data = self.data.narrow(1, start // QK * size, length // QK * size).contiguous()
        return QuantizedWeight(self.format, (self.shape[0], length), data)

    def index_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows at ``index`` (a permutation, or the rows an embedding looks up)."""
        scales = None if self.scales is None else self.scales.index_select(0, index)
        return QuantizedWeight(self.format, (len(index), self.shape[1]), self.data.index_select(0, index), scales)


@dataclass
class QuantizedExperts:
    """One projection of every local expert of an MoE layer in one packed format, stacked as the kernels read it:
    ``data [experts, out_features, row bytes]`` (one :class:`QuantizedWeight`'s rows per expert) and, for ``int8``,
    ``scales [experts, out_features]``."""

    format: str
    shape: tuple[int, int, int]  # experts, out_features, in_features
    data: torch.Tensor
    scales: Optional[torch.Tensor] = None

    @classmethod
    def stack(cls, weights: list[QuantizedWeight]) -> QuantizedExperts:
        """The experts' weights (one format and shape) stacked."""
        if not weights or len({(w.format, w.shape) for w in weights}) != 1:
            raise ValueError(f"cannot stack experts {[(w.format, w.shape) for w in weights]}: one format and shape")
        first = weights[0]
        scales = None if first.scales is None else torch.stack([w.scales for w in weights if w.scales is not None])
        data = torch.stack([w.data for w in weights]).contiguous()
        return cls(first.format, (len(weights), *first.shape), data, scales)

    def narrow(self, start: int, count: int) -> QuantizedExperts:
        """Experts ``[start, start + count)`` (the ones an expert-parallel rank holds)."""
        scales = None if self.scales is None else self.scales[start : start + count]
        return QuantizedExperts(self.format, (count, *self.shape[1:]), self.data[start : start + count], scales)

    def expert(self, index: int) -> QuantizedWeight:
        """Expert ``index``'s weight ``[out_features, in_features]``."""
        scales = None if self.scales is None else self.scales[index]
        return QuantizedWeight(self.format, self.shape[1:], self.data[index], scales)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (0 if self.scales is None else self.scales.nbytes)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output rows (fused QKV, gate and up)."""
    formats = {p.format for p in parts}
    if len(formats) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot stack {[(p.format, p.shape) for p in parts]}: one format and width needed")
    scales = None if parts[0].scales is None else torch.cat([p.scales for p in parts if p.scales is not None])
    rows = sum(p.shape[0] for p in parts)
    return QuantizedWeight(parts[0].format, (rows, parts[0].shape[1]), torch.cat([p.data for p in parts]), scales)


def _half(data: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 stored at byte ``offset`` of every block, as float32 ``[rows, blocks, 1]``."""
    return data[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).float()


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight a packed one stands for (the reference of every quantized kernel)."""
    rows, cols = weight.shape
    if weight.format == "int8":
        assert weight.scales is not None  # int8 rows always carry their scales
        return weight.data[:, :cols].float() * weight.scales.float().unsqueeze(1)
    blocks = weight.data.reshape(rows, cols // QK, BLOCK_BYTES[weight.format])
    if weight.format == "q4_0":
        out = _half(blocks, 0) * (_nibbles(blocks[..., 2:]) - 8)
    elif weight.format == "q4_1":
        out = _half(blocks, 0) * _nibbles(blocks[..., 4:]) + _half(blocks, 2)
    else:
        out = _half(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    return out.reshape(rows, cols)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero), as llama.cpp rounds; torch.round rounds ties to even."""
    return torch.sign(values) * torch.floor(values.abs() + 0.5)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as the integer kernels see it: each block of 32 values of a row scaled to int8 (Q8_0 with a
    float32 scale), returned in float32. The products of the kernels equal ``quantize_activations(x) @
    dequantize(w).T`` up to float rounding."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % QK)).reshape(rows, -1, QK)
    d = padded.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (_round_half_away(padded * inverse) * d).reshape(rows, -1)[:, :cols]


def _pack_blocks(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    return torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()


def _halves_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).contiguous().view(torch.uint8)


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Quantize a float weight ``[out, in]`` into ``fmt`` (llama.cpp's reference rounding for the GGUF formats)."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    if fmt == "int8":
        scales = weight.abs().amax(dim=1) / 127
        inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
        q = _round_half_away(weight * inverse.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        if cols % QK:
            q = torch.nn.functional.pad(q, (0, -cols % QK))
        return QuantizedWeight("int8", (rows, cols), q.contiguous(), scales.contiguous())
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown quantized format '{fmt}'; formats: {FORMATS}")
    if cols % QK:
        raise ValueError(f"{fmt} needs in_features divisible by {QK}, got {cols}")
    x = weight.reshape(rows, cols // QK, QK)
    if fmt == "q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = _round_half_away(x * inverse).to(torch.int8).view(torch.uint8)
        return QuantizedWeight(fmt, (rows, cols), _pack_blocks([_halves_bytes(d), q], rows))
    if fmt == "q4_0":
        index = x.abs().argmax(dim=-1, keepdim=True)
        d = x.gather(-1, index) / -8
        inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(x * inverse + 8.5), 0, 15).to(torch.uint8)
        head = [_halves_bytes(d)]
    else:
        low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        d = (high - low) / 15
        inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc((x - low) * inverse + 0.5), 0, 15).to(torch.uint8)
        head = [_halves_bytes(d), _halves_bytes(low)]
    qs = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedWeight(fmt, (rows, cols), _pack_blocks([*head, qs], rows))


def reference_product(weight: QuantizedWeight, bias: Optional[torch.Tensor] = None):
    """``x @ dequantize(weight).T + bias``, de-quantizing on every call: the slow, exact reference path."""
    bias = None if bias is None else bias.detach().float()

    def product(x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.float(), dequantize(weight), bias)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    return product
