"""Llama family (SmolLM2, Llama 2/3, Mistral) from tensor-parallel-ready layers; the base of the other families."""

from __future__ import annotations

from itertools import islice
from typing import Iterable, Optional

import torch
from torch import nn

from engine.distributed.parallel_state import get_pp_group, get_tp_group, pipeline_layer_range
from engine.model.layers.activation import SiluAndMul
from engine.model.layers.attention import Attention
from engine.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
    weight_loader_of,
)
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding, rope_settings
from engine.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from engine.model.model_info import layer_sliding_windows
from engine.model.pipeline import IntermediateTensors, PPMissingLayer, is_pp_missing_parameter


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Fused-QKV attention with rotary embeddings; families override the class hooks below."""

    qk_norm_cls: Optional[type] = None  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)

    def __init__(self, config, layer_index: int, prefix: str):
        super().__init__()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_size, self.total_num_heads, self.total_num_kv_heads, bias=qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_size,
            config.hidden_size,
            bias=o_bias,
            input_partition=(self.qkv_proj.q_head_start * self.head_size, self.q_size),
        )
        if self.qk_norm_cls is not None:
            self.q_norm = self.qk_norm_cls(self.head_size, config.rms_norm_eps)
            self.k_norm = self.qk_norm_cls(self.head_size, config.rms_norm_eps)
        theta, scaling = self.rope_parameters(config, layer_index)
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(
            f"{prefix}.attn",
            self.num_heads,
            self.head_size,
            self.attention_scale(config),
            self.num_kv_heads,
            sliding_window=layer_sliding_windows(config)[layer_index],
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def projection_biases(self, config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o) as the family's checkpoints have them."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bool(getattr(config, "o_proj_bias", bias) and bias)

    def rope_parameters(self, config, layer_index: int):
        return rope_settings(config)

    def attention_scale(self, config) -> float:
        return self.head_size**-0.5

    def _norm_heads(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(x.shape[0], -1, self.head_size)).reshape(x.shape[0], -1)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_cls is not None:
            q, k = self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, prefix: str, attention_cls: type = LlamaAttention):
        super().__init__()
        self.self_attn = attention_cls(config, layer_index, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_index: int) -> nn.Module:
        """This layer's feed-forward block: the SiLU-gated MLP (MoE families return their sparse block here)."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream: returns (this layer's MLP output, the residual before it);
        their sum is the layer's output, added by the next norm (one fused add + RMSNorm)."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """The decoder stack; under pipeline parallelism, this stage's slice of it (the embedding on the first
    stage, the final norm on the last, ``PPMissingLayer`` for what other stages hold)."""

    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, config, attention_cls: type = LlamaAttention, prefix: str = "model"):
        super().__init__()
        self.pp = get_pp_group()
        self.hidden_size = config.hidden_size
        self.start_layer, self.end_layer = pipeline_layer_range(
            config.num_hidden_layers, self.pp.rank, self.pp.world_size
        )
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # a tied LM head is the embedding table: the last stage holds a copy of it
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if self.pp.is_first_rank or (tied and self.pp.is_last_rank)
            else PPMissingLayer()
        )
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, f"{prefix}.layers.{i}", attention_cls)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps) if self.pp.is_last_rank else PPMissingLayer()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def stage_layers(self):
        return islice(self.layers, self.start_layer, self.end_layer)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Buffers for what the previous stage sends: the hidden states and the residual stream."""
        shape = (num_tokens, self.hidden_size)
        return {
            "hidden_states": torch.empty(shape, dtype=dtype, device=device),
            "residual": torch.empty(shape, dtype=dtype, device=device),
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Optional[IntermediateTensors] = None,
    ):
        """The final hidden states on the last stage; the residual stream's tensors on the others."""
        if self.pp.is_first_rank:
            hidden_states, residual = self.embed(input_ids), None
        else:
            assert intermediate_tensors is not None  # a later stage always receives the residual stream
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.stage_layers():
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.pp.is_last_rank:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM head over LlamaModel; ``load_weights`` takes Hugging Face tensor names."""

    model_cls: type[LlamaModel] = LlamaModel
    attention_cls: type[nn.Module] = LlamaAttention
    supports_pp = True  # builds only its pipeline stage's layers; forward takes intermediate_tensors
    # checkpoint name piece -> (fused parameter name piece, shard id)
    stacked_params_mapping = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, self.attention_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not get_pp_group().is_last_rank:
            self.lm_head = None  # the last stage computes the logits
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tp = get_tp_group()
        self.logits_gemm = None  # set by the loader: the LM-head product on a packed weight (LayerKernels.pack_linear)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Optional[IntermediateTensors] = None,
    ):
        return self.model(input_ids, positions, intermediate_tensors)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        return self.model.make_empty_intermediate_tensors(num_tokens, dtype, device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.logits_gemm is not None:
            logits = self.logits_gemm(hidden_states)
        else:
            logits = linear(hidden_states, self.lm_head.weight)
        logits = self.tp.all_gather(logits, dim=-1)
        vocab_size = self.config.vocab_size
        if logits.shape[-1] != vocab_size:  # a padded (sharded) vocabulary
            logits = logits[..., :vocab_size]
        if logits.dtype != torch.float32:  # (a decode step's logits are float32 already: no dispatch)
            logits = logits.float()
        soft_cap = getattr(self.config, "final_logit_softcapping", None)
        if soft_cap:
            logits = torch.tanh(logits / soft_cap) * soft_cap
        return logits

    def checkpoint_target(self, name: str) -> tuple[str, tuple]:
        """The parameter a checkpoint tensor fills and the extra arguments of its weight loader (the shard of a
        fused layer; families with experts add the expert id)."""
        for ckpt_piece, param_piece, shard_id in self.stacked_params_mapping:
            if ckpt_piece in name:
                return name.replace(ckpt_piece, param_piece), (shard_id,)
        return name, ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into (sharded, fused) parameters; return the parameter names set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            target, loader_args = self.checkpoint_target(name)
            if target not in params:
                if is_pp_missing_parameter(target, self):
                    continue  # another pipeline stage holds it
                raise ValueError(f"checkpoint tensor '{name}' has no place in {type(self).__name__}")
            param = params[target]
            weight_loader_of(param)(param, tensor.to(param.dtype), *loader_args)
            loaded.add(target)
        return loaded
