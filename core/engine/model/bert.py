"""BERT and XLM-RoBERTa encoders (bidirectional attention) for embeddings and cross-encoder classification."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group
from engine.model.layers.attention import Attention
from engine.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    weight_loader_of,
)
from engine.model.layers.vocab import VocabParallelEmbedding
from engine.model.model_info import TOKEN_ID_MASK, TOKEN_TYPE_SHIFT

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported by the BERT layers; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm. A prompt id carries its token type
    above ``TOKEN_TYPE_SHIFT`` (the front end packs a pair's second segment as type 1)."""

    def __init__(self, config, position_offset: int = 0):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, config.type_vocab_size), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset  # RoBERTa: positions start past the padding index

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_types = input_ids >> TOKEN_TYPE_SHIFT
        if self.token_type_embeddings.num_embeddings == 1:
            token_types = torch.zeros_like(token_types)
        embeddings = self.word_embeddings(input_ids & TOKEN_ID_MASK)
        embeddings = embeddings + self.position_embeddings(positions + self.position_offset)
        embeddings = embeddings + self.token_type_embeddings(token_types)
        return self.LayerNorm(embeddings)


class BertLayer(nn.Module):
    """Post-norm encoder layer: self-attention (fused QKV, tensor-parallel by head) and a GELU MLP, each followed by
    a residual add and LayerNorm."""

    def __init__(self, config, prefix: str):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_size = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, heads, bias=True)
        num_heads = self.qkv_proj.num_heads
        self.q_size = num_heads * self.head_size
        self.attn = Attention(
            f"{prefix}.attn", num_heads, self.head_size, self.head_size**-0.5, num_heads, attn_type="encoder_only"
        )
        self.attention_output = RowParallelLinear(hidden, hidden, bias=True)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = ColumnParallelLinear(hidden, [config.intermediate_size], bias=True)
        self.act = activation(config.hidden_act)
        self.output = RowParallelLinear(config.intermediate_size, hidden, bias=True)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size] * 3, dim=-1)
        attended = self.attention_output(self.attn(q, k, v))
        hidden_states = self.attention_norm(attended + hidden_states)
        return self.output_norm(self.output(self.act(self.intermediate(hidden_states))) + hidden_states)


# Hugging Face name piece -> (this model's name piece, shard of a fused layer)
_LAYER_NAMES = [
    (".attention.self.query.", ".qkv_proj.", "q"),
    (".attention.self.key.", ".qkv_proj.", "k"),
    (".attention.self.value.", ".qkv_proj.", "v"),
    (".attention.output.dense.", ".attention_output.", None),
    (".attention.output.LayerNorm.", ".attention_norm.", None),
    (".intermediate.dense.", ".intermediate.", None),
    (".output.dense.", ".output.", None),
    (".output.LayerNorm.", ".output_norm.", None),
]


class BertModel(nn.Module):
    """The encoder: embeddings and layers; ``forward`` gives every token's final hidden state (``[T, H]``).

    Encoder-only pooling models serve whole prompts in one step (no chunked prefill, no prefix cache): their
    attention layers are ``encoder_only``, which the attention backend must implement."""

    position_offset_from_padding = False  # RoBERTa: True
    checkpoint_prefixes: tuple[str, ...] = ("bert.",)  # a base model saved inside a task model
    ignored_prefixes: tuple[str, ...] = ("pooler.", "cls.", "lm_head.")  # heads an embedding model does not use

    def __init__(self, config):
        super().__init__()
        self.config = config
        offset = int(config.pad_token_id or 0) + 1 if self.position_offset_from_padding else 0
        self.embeddings = BertEmbeddings(config, offset)
        self.layers = nn.ModuleList(BertLayer(config, f"encoder.layer.{i}") for i in range(config.num_hidden_layers))
        self.tp = get_tp_group()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids, positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states

    def parameter_name(self, name: str) -> tuple[Optional[str], tuple]:
        """This model's parameter for a checkpoint tensor (None: a tensor it ignores) and its loader's arguments."""
        for prefix in self.checkpoint_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(self.ignored_prefixes) or name.endswith("position_ids"):
            return None, ()
        if name.startswith("encoder.layer."):
            name = "layers." + name[len("encoder.layer.") :]
            for hf_piece, piece, shard in _LAYER_NAMES:
                if hf_piece in name:
                    return name.replace(hf_piece, piece), (() if shard is None else (shard,))
        return name, ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, loader_args = self.parameter_name(name)
            if target is None:
                continue
            # LayerNorm weights are saved as gamma / beta by old BERT checkpoints
            target = target.replace(".gamma", ".weight").replace(".beta", ".bias")
            if target not in params:
                raise ValueError(f"checkpoint tensor '{name}' has no place in {type(self).__name__}")
            param = params[target]
            weight_loader_of(param)(param, tensor.to(param.dtype), *loader_args)
            loaded.add(target)
        return loaded


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa / RoBERTa encoders: BERT's layers, positions counted from past the padding index."""

    position_offset_from_padding = True
    checkpoint_prefixes = ("roberta.",)


class BertForSequenceClassification(BertModel):
    """BERT cross-encoders: the [CLS] state through the pooler (dense + tanh) and the classifier."""

    ignored_prefixes = ("cls.",)

    def __init__(self, config):
        super().__init__(config)
        self.pooler = nn.Module()
        self.pooler.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] first-token states -> [B, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler.dense(pooled)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa cross-encoders (bge-reranker...): the <s> state through the classification head (dense, tanh,
    out_proj)."""

    ignored_prefixes = ("lm_head.", "pooler.")

    def __init__(self, config):
        super().__init__(config)
        self.classifier = nn.Module()
        self.classifier.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier.out_proj = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(pooled)))
