"""Linear layers sharded by tensor-parallel rank: column (incl. merged and QKV) and row parallel, and replicated
(every rank holds the whole weight: MoE routers)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group
from engine.model.quant_formats import QuantizedWeight, cat_rows, dequantize

PackedProduct = Callable[[torch.Tensor], torch.Tensor]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, packed: Optional[PackedProduct] = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` in the weight's dtype, returned in the activation's dtype; through
    ``packed`` (the same product on a packed weight, from ``LayerKernels.pack_linear``) when the
    layer kernels made one."""
    if packed is not None:
        return packed(x)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return out.to(x.dtype)


def _param(shape: Sequence[int], loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]  # read back by weight_loader_of
    return param


class ColumnParallelLinear(nn.Module):
    """y = xW^T + b with W split along its output rows; each rank keeps its slice of y."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            if size % self.tp_size:
                raise ValueError(f"output size {size} is not divisible by tensor_parallel_size {self.tp_size}")
        self.output_size_per_partition = sum(self.output_sizes) // self.tp_size
        self.weight = _param((self.output_size_per_partition, input_size), self.weight_loader)
        self.bias = _param((self.output_size_per_partition,), self.weight_loader) if bias else None
        self.packed = None  # set by the loader: the same product on a packed weight (LayerKernels.pack_linear)
        self.lora = None  # set with LoRA enabled: the adapters' weights added to this product (LoRALinear)

    def shard_bounds(self, shard_id) -> tuple[int, int, int]:
        """(offset in this rank's param, size, offset in the full checkpoint tensor) of a shard."""
        index = 0 if shard_id is None else shard_id
        offset = sum(self.output_sizes[:index]) // self.tp_size
        size = self.output_sizes[index] // self.tp_size
        return offset, size, self.tp_rank * size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None and len(self.output_sizes) > 1:
            raise ValueError("a merged layer needs the shard id of each checkpoint tensor")
        offset, size, src_offset = self.shard_bounds(shard_id)
        if not keep_quantized_shard(self, param, offset, loaded.narrow(0, src_offset, size)):
            param.data.narrow(0, offset, size).copy_(loaded.narrow(0, src_offset, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.packed)
        return out if self.lora is None else self.lora.apply(x, out)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""


def even_partition(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part ``index`` when ``total`` items split as evenly as possible, larger parts first."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


class QKVParallelLinear(nn.Module):
    """Q, K and V projections fused, split by KV-head group.

    Each rank takes a contiguous run of KV heads (as even as the count allows) with the query heads
    that attend to them; with more ranks than KV heads, KV heads are replicated and query heads
    split evenly.
    """

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ):
        super().__init__()
        tp = get_tp_group()
        if total_num_heads % total_num_kv_heads:
            raise ValueError(f"{total_num_heads} query heads are not a multiple of {total_num_kv_heads} KV heads")
        group = total_num_heads // total_num_kv_heads
        if tp.world_size <= total_num_kv_heads:
            kv_start, kv_count = even_partition(total_num_kv_heads, tp.world_size, tp.rank)
            q_start, q_count = kv_start * group, kv_count * group
        else:
            if tp.world_size % total_num_kv_heads or total_num_heads % tp.world_size:
                raise ValueError(
                    f"tensor_parallel_size {tp.world_size} cannot split {total_num_heads} query / "
                    f"{total_num_kv_heads} KV heads"
                )
            kv_start, kv_count = tp.rank // (tp.world_size // total_num_kv_heads), 1
            q_count = total_num_heads // tp.world_size
            q_start = tp.rank * q_count
        self.head_size = head_size
        self.num_heads, self.num_kv_heads = q_count, kv_count
        self.q_head_start, self.kv_head_start = q_start, kv_start
        self.shards = {
            "q": (0, q_start, q_count),
            "k": (q_count, kv_start, kv_count),
            "v": (q_count + kv_count, kv_start, kv_count),
        }  # (offset in param, first head, heads)
        rows = (q_count + 2 * kv_count) * head_size
        self.input_size, self.output_size_per_partition = hidden_size, rows
        self.weight = _param((rows, hidden_size), self.weight_loader)
        self.bias = _param((rows,), self.weight_loader) if bias else None
        self.packed = None  # set by the loader: the same product on a packed weight (LayerKernels.pack_linear)
        self.lora = None  # set with LoRA enabled: the adapters' weights added to this product (LoRALinear)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, first_head, heads = self.shards[shard_id]
        size = self.head_size
        shard = loaded.narrow(0, first_head * size, heads * size)
        if not keep_quantized_shard(self, param, offset * size, shard):
            param.data.narrow(0, offset * size, heads * size).copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.packed)
        return out if self.lora is None else self.lora.apply(x, out)


class RowParallelLinear(nn.Module):
    """y = xW^T + b with W split along its input columns; partial sums are all-reduced."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, input_partition: Optional[tuple[int, int]] = None
    ):
        """``input_partition`` = (start, size) of this rank's input columns when not an even split."""
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        if input_partition is None:
            if input_size % tp.world_size:
                raise ValueError(f"input size {input_size} is not divisible by tensor_parallel_size {tp.world_size}")
            size = input_size // tp.world_size
            input_partition = (tp.rank * size, size)
        self.input_start, self.input_size_per_partition = input_partition
        self.output_size = output_size
        self.weight = _param((output_size, self.input_size_per_partition), self.weight_loader)
        self.bias = _param((output_size,), self._bias_loader) if bias else None
        self.packed = None  # set by the loader: the same product on a packed weight (LayerKernels.pack_linear)
        self.lora = None  # set with LoRA enabled: the adapters' weights added before the all-reduce (LoRALinear)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded.narrow(1, self.input_start, self.input_size_per_partition)
        if not keep_quantized_shard(self, param, 0, shard):
            param.data.copy_(shard)

    @staticmethod
    def _bias_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, packed=self.packed)
        if self.lora is not None:  # this rank's input columns: the ranks' deltas sum to the whole one
            out = self.lora.apply(x, out)
        out = self.tp.all_reduce(out)
        return out + self.bias if self.bias is not None else out


class ReplicatedLinear(nn.Module):
    """y = xW^T + b with the whole weight on every rank (an MoE router, a shared expert's gate, MLA's down
    projections); ``params_dtype`` keeps it in another dtype than the model's (DeepSeek-V3 routes in float32), computed
    in that dtype. Weight-only quantization leaves it in float where ``keep_float`` (the default: routers, as vLLM
    leaves them, so a token's experts do not move with the rounding)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        keep_float: bool = True,
    ):
        super().__init__()
        self.keep_float = keep_float
        self.params_dtype = params_dtype
        self.weight = _param((output_size, input_size), self.weight_loader)
        self.bias = _param((output_size,), default_weight_loader) if bias else None
        if params_dtype is not None:
            self.weight.data = self.weight.data.to(params_dtype)
            if self.bias is not None:
                self.bias.data = self.bias.data.to(params_dtype)
        self.packed = None  # set by the loader: the same product on a packed weight (LayerKernels.pack_linear)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight, shard_id=None) -> None:
        """A packed checkpoint weight (a GGUF file's blocks) stays packed unless the layer keeps float (a router:
        de-quantized)."""
        if isinstance(loaded, QuantizedWeight):
            if not self.keep_float and tuple(loaded.shape) == tuple(param.shape):
                keep_quantized_shard(self, param, 0, loaded)
                return
            loaded = dequantize(loaded)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.params_dtype is not None:
            x = x.to(self.params_dtype)
        return linear(x, self.weight, self.bias, self.packed)


def keep_quantized_shard(module: nn.Module, param: nn.Parameter, row_offset: int, shard) -> bool:
    """Keep a packed checkpoint shard of a layer's weight (its rows from ``row_offset``) until every shard is in;
    ``finish_quantized_weight`` stacks them. False for a float shard (copied into the parameter as usual)."""
    if not isinstance(shard, QuantizedWeight):
        return False
    if param is not getattr(module, "weight", None):
        raise ValueError(f"a quantized checkpoint tensor for a {type(module).__name__} parameter other than its weight")
    module.__dict__.setdefault("_quant_shards", {})[row_offset] = shard
    return True


def finish_quantized_weight(module: Any) -> None:
    """Stack the packed shards a layer received into ``module.quant_weight`` and release its float weight; a layer
    whose shards came in mixed formats (or mixed with float ones) gets them de-quantized into the float weight."""
    shards = module.__dict__.pop("_quant_shards", None)
    if not shards:
        return
    rows = sum(s.shape[0] for s in shards.values())
    ordered = [shards[offset] for offset in sorted(shards)]
    if rows == module.weight.shape[0] and len({s.format for s in ordered}) == 1:
        set_quantized_weight(module, cat_rows(ordered) if len(ordered) > 1 else ordered[0])
        return
    for offset, shard in shards.items():  # de-quantize into the float weight
        module.weight.data.narrow(0, offset, shard.shape[0]).copy_(dequantize(shard))


def set_quantized_weight(module: Any, weight: QuantizedWeight) -> None:
    """Make ``weight`` the layer's weight: the float parameter keeps its dtype and is emptied (its memory goes)."""
    module.quant_weight = weight
    module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def weight_loader_of(param: nn.Parameter):
    return getattr(param, "weight_loader", default_weight_loader)


def linear_layers(model: nn.Module, quantized: Optional[bool] = None) -> list[Any]:
    """Every tensor-parallel linear layer of a model (``quantized``: only those with, or without, a
    ``quant_weight``)."""
    kinds = (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, ReplicatedLinear)
    layers = [m for m in model.modules() if isinstance(m, kinds)]
    if quantized is None:
        return layers
    return [m for m in layers if (getattr(m, "quant_weight", None) is not None) == quantized]
