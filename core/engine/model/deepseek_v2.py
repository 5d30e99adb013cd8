"""DeepSeek-V2 / V3: multi-head latent attention (MLA) with DeepSeek's mixture of experts (``deepseek.py``).

Each layer projects the hidden state to a query (directly, or through the low-rank ``q_a_proj`` -> norm ->
``q_b_proj`` when ``q_lora_rank`` is set) and to one compressed latent (``kv_a_proj_with_mqa``: ``kv_lora_rank``
values, normalised, plus a ``qk_rope_head_dim`` rotary key shared by all heads). Only the latent and the rotary key
are cached; ``kv_b_proj`` expands them into per-head keys and values (see ``engine.attention.mla``).

DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3)...``; the loader permutes the rotary rows of the query and
latent projections into the half-split layout, so the ordinary (GPT-NeoX) rotary kernel applies and every dot
product is unchanged.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from engine.model.deepseek import DEEPSEEK_RENAMED_MODULES, deepseek_mlp
from engine.model.layers.attention import MLAAttention
from engine.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding, rope_settings, yarn_mscale
from engine.model.llama import LlamaDecoderLayer, LlamaModel
from engine.model.quant_formats import QuantizedWeight
from engine.model.sparse_moe import MoEForCausalLM

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm use the default epsilon, not rms_norm_eps


def mla_softmax_scale(config) -> float:
    """1/sqrt(qk_head_dim), times YaRN's ``mscale_all_dim`` correction squared when the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_settings(config)
    if scaling and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class LatentExpansion(ColumnParallelLinear):
    """``kv_b_proj``: the latent -> per-head (k_nope, v) expansion, split by heads over tensor-parallel ranks. The
    MLA implementation reads its weight (expanded prefill, absorbed decode), so quantization leaves it in float."""

    keep_float = True


class DeepseekV2MLAAttention(nn.Module):
    """MLA's projections around the :class:`MLAAttention` layer; heads are split over tensor-parallel ranks, the
    latent is computed (and cached) whole on every rank."""

    def __init__(self, config, layer_index: int, prefix: str):
        super().__init__()
        self.total_num_heads = config.num_attention_heads
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, keep_float=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [self.total_num_heads * qk_head_dim])
        else:
            self.q_proj = ColumnParallelLinear(hidden, [self.total_num_heads * qk_head_dim])
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.rope_dim, bias=bias, keep_float=False
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentExpansion(self.kv_lora_rank, [self.total_num_heads * (self.nope_dim + self.v_head_dim)])
        self.num_heads = self.total_num_heads // self.kv_b_proj.tp_size
        self.o_proj = RowParallelLinear(self.total_num_heads * self.v_head_dim, hidden, bias=bias)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, config.max_position_embeddings, theta, scaling)
        self.mla_attn = MLAAttention(
            f"{prefix}.attn",
            self.num_heads,
            mla_softmax_scale(config),
            self.kv_lora_rank,
            self.nope_dim,
            self.rope_dim,
            self.v_head_dim,
            lambda: self.kv_b_proj.weight,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(
            positions, q[..., self.nope_dim :].reshape(tokens, -1).contiguous(), k_pe.contiguous()
        )
        q = torch.cat([q[..., : self.nope_dim], q_pe.view(tokens, self.num_heads, self.rope_dim)], dim=-1)
        return self.o_proj(self.mla_attn(q, kv_c_normed, k_pe))


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_index: int) -> nn.Module:
        return deepseek_mlp(config, layer_index)


class DeepseekV2Model(LlamaModel):
    decoder_layer_cls = DeepseekV2DecoderLayer


def _half_split(rows: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary rows (pairs 2i, 2i+1) reordered as evens then odds (the rotate-half layout)."""
    return torch.cat([rows[0::2], rows[1::2]])


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2 (softmax routing, greedy or group-limited) and, through its config, DeepSeek-V3 (sigmoid scores
    with a correction bias), with or without ``q_lora_rank``."""

    model_cls = DeepseekV2Model
    attention_cls = DeepseekV2MLAAttention
    renamed_modules = DEEPSEEK_RENAMED_MODULES
    stacked_params_mapping = [(".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)]

    @staticmethod
    def num_experts(config) -> int:
        return int(getattr(config, "n_routed_experts", None) or 0)

    def rope_interleaved(self) -> bool:
        return True  # DeepSeek-V2 always rotates interleaved pairs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._half_split_rope(weights) if self.rope_interleaved() else weights)

    def _half_split_rope(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The query's and the latent's rotary rows in the rotate-half layout: a permutation of whole rows, so a
        weight kept packed (a GGUF file's blocks) is reordered as its float form would be."""
        config = self.config
        nope, rope, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
        for name, tensor in weights:
            order = None
            if name.endswith(("q_proj.weight", "q_b_proj.weight")):
                heads = torch.arange(tensor.shape[0]).view(config.num_attention_heads, nope + rope)
                order = torch.cat([heads[:, :nope], _half_split(heads[:, nope:].transpose(0, 1)).transpose(0, 1)], 1)
            elif name.endswith(("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
                rows = torch.arange(tensor.shape[0])
                order = torch.cat([rows[:rank], _half_split(rows[rank:])])
            if order is not None:
                order = order.reshape(-1)
                tensor = tensor.index_rows(order) if isinstance(tensor, QuantizedWeight) else tensor[order]
            yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's layers with V3's routing (read from the config); ``rope_interleave`` may be off."""

    def rope_interleaved(self) -> bool:
        return bool(getattr(self.config, "rope_interleave", True))
