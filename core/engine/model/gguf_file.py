"""Reading GGUF files: metadata as a transformers config, tensors de-quantized, Q/K un-permuted."""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np
import torch

from engine.model.quant_formats import BLOCK_BYTES, GGUF_TYPES, QK, QuantizedWeight

# GGUF architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama")}


@functools.lru_cache(maxsize=2)
def open_gguf(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return field.contents() if field is not None else default


def gguf_to_hf_config(path: str):
    """Build the transformers config a Hugging Face folder of the same model would carry."""
    from transformers import AutoConfig

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture '{arch}' is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    rope = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    config = AutoConfig.for_model(
        model_type,
        architectures=[hf_arch],
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        vocab_size=int(vocab),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
    )
    return config


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves rotary halves of q/k rows per head; restore Hugging Face's order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iterate_gguf_weights(
    path: str, hf_config, keep_packed: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (Hugging Face name, tensor) for every tensor of the file: float32, or, for 2-D tensors whose GGML type
    is one of the formats in ``keep_packed``, a :class:`QuantizedWeight` holding the file's blocks (rows un-permuted
    like the float ones, nothing de-quantized)."""
    import gguf

    reader = open_gguf(path)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        heads = (
            hf_config.num_attention_heads
            if name.endswith("q_proj.weight")
            else hf_config.num_key_value_heads
            if name.endswith("k_proj.weight")
            else None
        )
        fmt = GGUF_TYPES.get(tensor.tensor_type.name)
        if fmt in keep_packed and tensor.data.ndim == 2:
            blocks = tensor.data if heads is None else _unpermute_rotary(tensor.data, heads)
            rows = blocks.shape[0]
            cols = blocks.shape[1] // BLOCK_BYTES[fmt] * QK
            yield name, QuantizedWeight(fmt, (rows, cols), torch.from_numpy(np.array(blocks, dtype=np.uint8)))
            continue
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if heads is not None:
            data = _unpermute_rotary(data, heads)
        yield name, torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
