"""Gemma 2 and Gemma 3 (text): sandwich norms, (1 + w) RMSNorm, scaled embeddings, GELU-tanh MLP,
interleaved sliding-window / full-attention layers and soft-capping where the config asks for it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.model.layers.rotary import rope_settings
from engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from engine.model.pipeline import IntermediateTensors


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, all in float32 before casting back (Gemma's convention)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"Gemma hidden_activation '{activation}' is not supported (gelu_pytorch_tanh, gelu)")
        self.approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma2Attention(LlamaAttention):
    def attention_scale(self, config) -> float:
        return config.query_pre_attn_scalar**-0.5


class Gemma3Attention(Gemma2Attention):
    qk_norm_cls = GemmaRMSNorm

    def rope_parameters(self, config, layer_index: int):
        """Sliding layers use the local base frequency, full layers the global one (and its scaling)."""
        params = getattr(config, "rope_parameters", None)
        layer_type = config.layer_types[layer_index]
        if isinstance(params, dict) and layer_type in params:
            theta = params[layer_type].get("rope_theta", 10000.0)
            scaling = params[layer_type] if params[layer_type].get("rope_type", "default") != "default" else None
            return float(theta), scaling
        if layer_type == "sliding_attention":  # transformers 4 style config
            return float(getattr(config, "rope_local_base_freq", 10000.0)), None
        return rope_settings(config)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after both the attention and the MLP."""

    def __init__(self, config, layer_index: int, prefix: str, attention_cls: type):
        super().__init__()
        self.self_attn = attention_cls(config, layer_index, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class GemmaModel(LlamaModel):
    """Embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype as the reference does."""

    decoder_layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config, attention_cls: type, prefix: str = "model"):
        super().__init__(config, attention_cls, prefix)
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        return {"hidden_states": torch.empty((num_tokens, self.hidden_size), dtype=dtype, device=device)}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Optional[IntermediateTensors] = None,
    ):
        # the sandwich norms sit between each sublayer and its residual add: no add to fuse into a norm
        if self.pp.is_first_rank:
            hidden_states = self.embed(input_ids)
        else:
            assert intermediate_tensors is not None  # a later stage always receives the residual stream
            hidden_states = intermediate_tensors["hidden_states"]
        for layer in self.stage_layers():
            hidden_states = layer(positions, hidden_states)
        if not self.pp.is_last_rank:
            return {"hidden_states": hidden_states}
        return self.norm(hidden_states)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: attention and final-logit soft-capping, every other layer sliding-window."""

    model_cls = GemmaModel
    attention_cls = Gemma2Attention


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 (text): q/k norms, five sliding-window layers to one full layer, per-type RoPE."""

    model_cls = GemmaModel
    attention_cls = Gemma3Attention
