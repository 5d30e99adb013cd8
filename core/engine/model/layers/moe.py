"""The routed experts of a mixture-of-experts block (vLLM's ``FusedMoE``): expert weights stacked per layer,
sharded over the tensor-parallel ranks or placed whole on them (expert parallelism), run by the layer kernels'
fused-MoE operation, with the tokens each expert received counted for ``get_stats()``.

Tensor parallelism (the default) gives every rank a slice of each expert's intermediate dimension; with
``parallel.enable_expert_parallel`` each rank of the group holds whole experts (an even, contiguous split of the
ids, as vLLM's linear placement). Either way the hidden states are the same on every rank, so a token reaches
its experts with no exchange (the dispatch is each rank picking the choices of its own experts) and the partial
outputs are summed by one all-reduce over the group (the combine).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.distributed.parallel_state import get_ep_group, get_tp_group
from engine.interfaces.layer_kernels import ExpertsProduct, MoERouting
from engine.model.layers.kernels import current_layer_kernels
from engine.model.layers.linear import even_partition
from engine.model.quant_formats import QuantizedExperts, QuantizedWeight, cat_rows, dequantize

# checkpoint projection -> the stacked parameter's prefix (vLLM's w1 = gate, w3 = up, w2 = down)
EXPERT_SHARDS = {"w1": "w13_", "w3": "w13_", "w2": "w2_"}
# the stacked layout some checkpoints use for every expert at once: [experts, 2 x intermediate, hidden] (gate rows,
# then up rows) and [experts, hidden, intermediate]
FUSED_EXPERT_PARAMS: list[tuple[str, str, Optional[int], str]] = [
    ("experts.w13_weight", "experts.gate_up_proj", None, "w13"),
    ("experts.w2_weight", "experts.down_proj", None, "w2"),
]


class FusedMoE(nn.Module):
    """The experts of one MoE layer: ``forward(hidden_states, router_logits)`` routes each token to its top-k experts
    (``LayerKernels.select_experts``) and returns the weighted sum of their outputs, reduced over the ranks.

    ``w13_weight`` is ``[local experts, 2 x intermediate per rank, hidden]`` (each expert's gate rows, then its
    up rows: packed as the dense MLP's gate/up), ``w2_weight`` ``[local experts, hidden, intermediate per rank]``.
    """

    expert_load: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: MoERouting,
        layer_index: int,
        has_correction_bias: bool = False,
        reduce_results: bool = True,
    ):
        super().__init__()
        tp, ep = get_tp_group(), get_ep_group()
        self.tp = tp
        self.num_experts = num_experts
        self.routing = routing
        self.layer_index = layer_index
        self.reduce_results = reduce_results
        if ep.world_size > 1:  # whole experts per rank; each expert's intermediate dimension unsplit
            if num_experts < ep.world_size:
                raise ValueError(f"{num_experts} experts cannot be spread over {ep.world_size} expert-parallel ranks")
            self.first_expert, self.num_local_experts = even_partition(num_experts, ep.world_size, ep.rank)
            self.shard_rank, shards = 0, 1
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.shard_rank, shards = tp.rank, tp.world_size
        if intermediate_size % shards:
            raise ValueError(
                f"expert intermediate size {intermediate_size} is not divisible by tensor_parallel_size {shards} "
                "(set parallel.enable_expert_parallel to place whole experts instead)"
            )
        self.num_shards = shards  # ranks that split each expert's intermediate dimension
        self.intermediate_per_rank = intermediate_size // shards
        size = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * size, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, size), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.e_score_correction_bias: Optional[nn.Parameter] = None
        if has_correction_bias:  # DeepSeek-V3's: kept in float32, as its router computes
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        self.expert_map: Optional[torch.Tensor] = None
        if self.num_local_experts != num_experts:
            self.expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
            local = slice(self.first_expert, self.first_expert + self.num_local_experts)
            self.expert_map[local] = torch.arange(self.num_local_experts)
        self.packed: Optional[ExpertsProduct] = None  # set by the loader (LayerKernels.pack_experts)
        # experts packed by a quantization method (set_quantized_experts), run by LayerKernels.pack_quantized_experts
        self.quant_w13: Optional[QuantizedExperts] = None
        self.quant_w2: Optional[QuantizedExperts] = None
        self.kernels = current_layer_kernels()
        # tokens routed to each expert (all of them, whichever rank holds it) since the engine started
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    @staticmethod
    def make_expert_params_mapping(
        num_experts: int, gate: str = "gate_proj", down: str = "down_proj", up: str = "up_proj"
    ) -> list[tuple[str, str, Optional[int], str]]:
        """``(parameter piece, checkpoint piece, expert id, shard id)`` for every expert's projections, as a model's
        ``load_weights`` matches checkpoint names (``experts.3.gate_proj.weight`` -> ``experts.w13_weight``), and
        for the stacked layout (``experts.gate_up_proj``, expert id None)."""
        per_expert: list[tuple[str, str, Optional[int], str]] = [
            (f"experts.{EXPERT_SHARDS[shard]}", f"experts.{expert}.{name}.", expert, shard)
            for expert in range(num_experts)
            for shard, name in (("w1", gate), ("w2", down), ("w3", up))
        ]
        return per_expert + FUSED_EXPERT_PARAMS

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: Optional[int] = None
    ) -> None:
        """Copy one expert's projection (``expert_id``) into this rank's slice of the stacked weight; with
        ``expert_id`` None, ``loaded`` stacks every expert (the fused ``experts.gate_up_proj`` / ``down_proj``
        layout, shard ``w13`` or ``w2``). An expert another rank holds is skipped."""
        if isinstance(loaded, QuantizedWeight):
            self._keep_quantized_shard(loaded, shard_id, expert_id)
            return
        size, start = self.intermediate_per_rank, self.shard_rank * self.intermediate_per_rank
        if expert_id is None:
            experts = loaded.narrow(0, self.first_expert, self.num_local_experts)
            if shard_id == "w13":
                full = experts.shape[1] // 2
                param.data[:, :size].copy_(experts[:, start : start + size])
                param.data[:, size:].copy_(experts[:, full + start : full + start + size])
            else:
                param.data.copy_(experts.narrow(2, start, size))
            return
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        if shard_id == "w2":
            self._check_shape(loaded, (param.shape[1], size * self.num_shards), expert_id)
            param.data[local].copy_(loaded.narrow(1, start, size))
            return
        self._check_shape(loaded, (size * self.num_shards, param.shape[2]), expert_id)
        offset = 0 if shard_id == "w1" else size
        param.data[local, offset : offset + size].copy_(loaded.narrow(0, start, size))

    def _keep_quantized_shard(self, loaded: QuantizedWeight, shard_id: str, expert_id: Optional[int]) -> None:
        """Keep one expert's packed projection (a GGUF file's blocks), this rank's rows (gate, up) or whole blocks of
        columns (down), until ``finish_quantized_experts`` stacks them."""
        if expert_id is None:
            raise ValueError("packed experts load expert by expert, not as one stacked tensor")
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        size, start = self.intermediate_per_rank, self.shard_rank * self.intermediate_per_rank
        full = size * self.num_shards
        if shard_id == "w2":
            self._check_shape(loaded, (self.w2_weight.shape[1], full), expert_id)
        else:
            self._check_shape(loaded, (full, self.w13_weight.shape[2]), expert_id)
        shard = loaded.narrow(1 if shard_id == "w2" else 0, start, size)
        self.__dict__.setdefault("_quant_shards", {})[(local, shard_id)] = shard

    def finish_quantized_experts(self) -> None:
        """Stack the packed expert shards this layer received into its quantized experts (``set_quantized_experts``);
        experts that came in mixed formats, or partly in float, are de-quantized into the float weights instead."""
        shards: dict = self.__dict__.pop("_quant_shards", None) or {}
        if not shards:
            return
        experts = range(self.num_local_experts)
        complete = len(shards) == 3 * self.num_local_experts and len({s.format for s in shards.values()}) == 1
        if complete:
            self.set_quantized_experts(
                QuantizedExperts.stack([cat_rows([shards[(e, "w1")], shards[(e, "w3")]]) for e in experts]),
                QuantizedExperts.stack([shards[(e, "w2")] for e in experts]),
            )
            return
        size = self.intermediate_per_rank
        for (local, shard_id), shard in shards.items():
            if shard_id == "w2":
                self.w2_weight.data[local].copy_(dequantize(shard))
            else:
                offset = 0 if shard_id == "w1" else size
                self.w13_weight.data[local, offset : offset + size].copy_(dequantize(shard))

    @staticmethod
    def _check_shape(loaded: torch.Tensor | QuantizedWeight, expected: tuple[int, int], expert_id: int) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert_id}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit {expected}"
            )

    def set_quantized_experts(self, w13: QuantizedExperts, w2: QuantizedExperts) -> None:
        """Make packed quantized weights this layer's experts (``w13 [experts, 2 x intermediate, hidden]``, ``w2
        [experts, hidden, intermediate]``, this rank's slices); the float weights are emptied (their memory goes)."""
        expected = (tuple(self.w13_weight.shape), tuple(self.w2_weight.shape))
        if (w13.shape, w2.shape) != expected:
            raise ValueError(f"quantized experts of shapes {w13.shape} / {w2.shape} do not fit {expected}")
        self.quant_w13, self.quant_w2 = w13, w2
        for param in (self.w13_weight, self.w2_weight):
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.kernels.select_experts(router_logits, self.routing, self.e_score_correction_bias)
        self.expert_load += torch.bincount(ids.flatten(), minlength=self.num_experts)
        out = self.kernels.fused_moe(hidden_states, self, weights, ids)
        return self.tp.all_reduce(out) if self.reduce_results else out


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert since the start, per MoE layer index (this rank's pipeline stage)."""
    return {layer.layer_index: layer.expert_load.tolist() for layer in moe_layers(model)}
