"""Reading GGUF files: metadata as a transformers config, tensors de-quantized (or kept packed), Q/K un-permuted.

Architectures: ``llama`` (Llama, and Mixtral: a ``llama`` file with ``llama.expert_count``) and ``qwen3moe``. An MoE
layer's experts are one 3-D tensor per projection in the file (``ffn_gate_exps`` ``[experts, intermediate, hidden]``
...); they are handed to the model expert by expert, under the names a Hugging Face checkpoint gives them."""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np
import torch

from engine.model.quant_formats import BLOCK_BYTES, GGUF_TYPES, QK, QuantizedWeight

# GGUF architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}
MIXTRAL = ("MixtralForCausalLM", "mixtral")  # a llama file with experts
ROTARY_PERMUTED = {"llama"}  # llama.cpp's converter interleaves the rotary halves of q/k rows for these
# the HF module of an MoE layer and its experts' (gate, down, up) names, per HF architecture
EXPERT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", ("w1", "w2", "w3"))}
DEFAULT_EXPERT_NAMES = ("mlp", ("gate_proj", "down_proj", "up_proj"))


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
    num_experts = _field(reader, f"{arch}.expert_count")
    if arch == "llama" and num_experts:
        hf_arch, model_type = MIXTRAL
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    num_layers = int(_field(reader, f"{arch}.block_count"))
    moe: dict = {}
    if num_experts:
        moe = dict(num_local_experts=int(num_experts)) if hf_arch == MIXTRAL[0] else dict(num_experts=int(num_experts))
        moe["num_experts_per_tok"] = int(_field(reader, f"{arch}.expert_used_count"))
    if arch == "qwen3moe":
        moe["moe_intermediate_size"] = int(_field(reader, f"{arch}.expert_feed_forward_length"))
        moe["norm_topk_prob"] = bool(_field(reader, f"{arch}.expert_weights_norm", True))
        # layers without experts (llama.cpp's qwen3moe has none; a converted checkpoint may) are dense
        moe["mlp_only_layers"] = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names]
        moe["decoder_sparse_step"] = 1
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    rope = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    config = AutoConfig.for_model(
        model_type,
        architectures=[hf_arch],
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(
            _field(reader, f"{arch}.attention.key_length", None)
            or _field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)
        ),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        vocab_size=int(vocab),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
        **moe,
    )
    return config


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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


_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_down_exps": 1, "ffn_up_exps": 2}  # index into the (gate, down, up) names


def _hf_name(gguf_name: str, hf_arch: str = "") -> str:
    """The Hugging Face name of a GGUF tensor; an expert tensor's names have ``{expert}`` in place of its index."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        block, layer = parts[2], f"model.layers.{parts[1]}"
        module, experts = EXPERT_NAMES.get(hf_arch, DEFAULT_EXPERT_NAMES)
        if block == "ffn_gate_inp":
            return f"{layer}.{module}.gate.{suffix}"
        if block in _EXPERT_TENSORS:
            return f"{layer}.{module}.experts.{{expert}}.{experts[_EXPERT_TENSORS[block]]}.{suffix}"
        return f"{layer}.{_LAYER_NAMES[block]}.{suffix}"
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
    hf_arch = (getattr(hf_config, "architectures", None) or [""])[0]
    permuted = _field(reader, "general.architecture") in ROTARY_PERMUTED
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, hf_arch)
        heads = None
        if permuted and name.endswith("q_proj.weight"):
            heads = hf_config.num_attention_heads
        elif permuted and name.endswith("k_proj.weight"):
            heads = hf_config.num_key_value_heads
        fmt = GGUF_TYPES.get(tensor.tensor_type.name)
        if fmt in keep_packed and tensor.data.ndim in (2, 3):
            blocks = tensor.data if heads is None else _unpermute_rotary(tensor.data, heads)
            for expert_name, rows in _per_expert(name, np.array(blocks, dtype=np.uint8)):
                cols = rows.shape[1] // BLOCK_BYTES[fmt] * QK
                yield expert_name, QuantizedWeight(fmt, (rows.shape[0], cols), torch.from_numpy(rows))
            continue
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if heads is not None:
            data = _unpermute_rotary(data, heads)
        for expert_name, values in _per_expert(name, np.array(data, dtype=np.float32)):  # writable copies
            yield expert_name, torch.from_numpy(values)


def _per_expert(name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """An expert tensor ``[experts, rows, ...]`` as one 2-D tensor per expert under its own name; others as they are."""
    if "{expert}" not in name:
        yield name, array
        return
    for expert, rows in enumerate(array):
        yield name.format(expert=expert), np.ascontiguousarray(rows)
