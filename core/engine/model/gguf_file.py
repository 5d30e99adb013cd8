"""Reading GGUF files: metadata as a transformers config, tensors de-quantized (or kept packed), Q/K un-permuted.

Architectures: ``llama`` (Llama, and Mixtral: a ``llama`` file with ``llama.expert_count``), ``qwen3moe``,
``deepseek2`` (DeepSeek-V2, and V3: sigmoid gating or a correction bias ``exp_probs_b``) and ``granitehybrid``
(Granite 4.0-H, and Bamba: Mamba2 mixers beside attention layers, told apart by their KV head count per layer) and
``jamba`` (Mamba1 mixers, attention and experts at periodic layers).
An MoE layer's experts are one 3-D tensor per projection in the file (``ffn_gate_exps`` ``[experts, intermediate,
hidden]`` ...); they are handed to the model expert by expert, under the names a Hugging Face checkpoint gives them.
llama.cpp writes DeepSeek's latent expansion ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and
``attn_v_b``, with or without ``attn_kv_b`` itself: where it is missing, ``kv_b_proj`` is rebuilt from the two."""

from __future__ import annotations

import functools
from typing import Any, Iterator

import numpy as np
import torch

from engine.model.quant_formats import BLOCK_BYTES, GGUF_TYPES, QK, QuantizedWeight

# GGUF architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    "jamba": ("JambaForCausalLM", "jamba"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")  # a llama file with experts
DEEPSEEK_V3 = ("DeepseekV3ForCausalLM", "deepseek_v3")  # a deepseek2 file with sigmoid gating
SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
BAMBA = ("BambaForCausalLM", "bamba")  # a granitehybrid file with rotary attention, a dense MLP and no multipliers
ROTARY_PERMUTED = {"llama", "granitehybrid"}  # llama.cpp's converter interleaves q/k rows' rotary halves for these
# the HF module of an MoE layer and its experts' (gate, down, up) names, per HF architecture
EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w2", "w3")),
    "GraniteMoeHybridForCausalLM": ("feed_forward.moe", ("gate_proj", "down_proj", "up_proj")),
    "JambaForCausalLM": ("feed_forward", ("gate_proj", "down_proj", "up_proj")),
}
DEFAULT_EXPERT_NAMES = ("mlp", ("gate_proj", "down_proj", "up_proj"))


@functools.lru_cache(maxsize=2)
def open_gguf(path: str):
    from engine.model.gguf_reader import FastGGUFReader

    return FastGGUFReader(path)


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
    if num_experts and arch in ("llama", "qwen3moe"):  # the others read their experts' settings below
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
    if arch == "deepseek2":
        attention, moe = _deepseek2_settings(reader, num_heads, tensor_names)
        if moe["scoring_func"] == "sigmoid":
            hf_arch, model_type = DEEPSEEK_V3
        rope.update(_yarn_settings(reader, arch))
    elif arch == "jamba":
        attention, moe = _jamba_settings(reader, num_heads, hidden, num_layers, tensor_names)
    elif arch == "granitehybrid":
        attention, moe = _granite_hybrid_settings(reader, num_heads, hidden, num_layers)
        if moe.pop("bamba"):
            hf_arch, model_type = BAMBA
            rope["partial_rotary_factor"] = moe.pop("partial_rotary_factor")
    else:
        attention = dict(
            num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(
                _field(reader, f"{arch}.attention.key_length", None)
                or _field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)
            ),
        )
    config = AutoConfig.for_model(
        model_type,
        architectures=[hf_arch],
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        vocab_size=int(vocab),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
        **attention,
        **moe,
    )
    return config


def _deepseek2_settings(reader, num_heads: int, tensor_names: set[str]) -> tuple[dict, dict]:
    """DeepSeek's attention and MoE settings from a ``deepseek2`` file. llama.cpp writes MLA as one KV head whose key
    is the latent and its rotary part (``key_length`` = kv_lora_rank + rope, ``value_length`` = kv_lora_rank) and the
    per-head sizes as ``key_length_mla`` / ``value_length_mla``; older files give the per-head sizes directly."""
    arch = "deepseek2"
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count"))
    key_mla, value_mla = (
        _field(reader, f"{arch}.attention.key_length_mla"),
        _field(reader, f"{arch}.attention.value_length_mla"),
    )
    key = int(key_mla if key_mla is not None else _field(reader, f"{arch}.attention.key_length"))
    value = int(value_mla if value_mla is not None else _field(reader, f"{arch}.attention.value_length"))
    q_lora_rank = _field(reader, f"{arch}.attention.q_lora_rank")
    attention = dict(
        num_key_value_heads=num_heads,
        head_dim=rope_dim,
        kv_lora_rank=int(_field(reader, f"{arch}.attention.kv_lora_rank")),
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key - rope_dim,
        v_head_dim=value,
    )
    sigmoid = _field(reader, f"{arch}.expert_gating_func") == SIGMOID_GATING or any(
        name.endswith("exp_probs_b.bias") for name in tensor_names
    )
    n_group = int(_field(reader, f"{arch}.expert_group_count", 1) or 1)
    moe = dict(
        n_routed_experts=int(_field(reader, f"{arch}.expert_count", 0) or 0),
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length", 0) or 0),
        n_shared_experts=int(_field(reader, f"{arch}.expert_shared_count", 0) or 0),
        first_k_dense_replace=int(_field(reader, f"{arch}.leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", False)),
        n_group=n_group,
        topk_group=int(_field(reader, f"{arch}.expert_group_used_count", 1) or 1),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"),
    )
    return attention, moe


def _granite_hybrid_settings(reader, num_heads: int, hidden: int, num_layers: int) -> tuple[dict, dict]:
    """Granite 4.0-H's (or Bamba's) settings from a ``granitehybrid`` file: the layer types from the per-layer KV head
    counts (0 for a Mamba2 mixer), the mixer's sizes, Granite's multipliers and experts. A file with rotary
    attention (``rope.scaling.finetuned``), no experts and no multipliers is a Bamba, as llama.cpp writes it."""
    arch = "granitehybrid"
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * num_layers
    inner = int(_field(reader, f"{arch}.ssm.inner_size"))
    mamba_heads = int(_field(reader, f"{arch}.ssm.time_step_rank"))
    use_rope = bool(_field(reader, f"{arch}.rope.scaling.finetuned", False))
    scales = {
        "embedding_multiplier": _field(reader, f"{arch}.embedding_scale"),
        "residual_multiplier": _field(reader, f"{arch}.residual_scale"),
        "attention_multiplier": _field(reader, f"{arch}.attention.scale"),
        "logits_scaling": _field(reader, f"{arch}.logit_scale"),
    }
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    head_dim = hidden // num_heads
    attention: dict[str, Any] = dict(
        num_key_value_heads=max(int(h) for h in kv_heads),
        mamba_n_heads=mamba_heads,
        mamba_d_head=inner // mamba_heads,
        mamba_n_groups=int(_field(reader, f"{arch}.ssm.group_count", 1)),
        mamba_d_state=int(_field(reader, f"{arch}.ssm.state_size")),
        mamba_d_conv=int(_field(reader, f"{arch}.ssm.conv_kernel")),
        mamba_expand=inner // hidden,
    )
    attention_layers = [i for i, h in enumerate(kv_heads) if int(h) > 0]
    bamba = use_rope and not experts and all(value is None for value in scales.values())
    if bamba:
        attention["attn_layer_indices"] = attention_layers
        rotary = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
        return attention, {"bamba": True, "partial_rotary_factor": rotary / head_dim}
    defaults = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": head_dim**-0.5}
    moe: dict[str, Any] = {
        key: float(value if value is not None else defaults.get(key, 1.0)) for key, value in scales.items()
    }
    feed_forward = int(_field(reader, f"{arch}.feed_forward_length"))
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    moe.update(
        bamba=False,
        layer_types=["attention" if i in attention_layers else "mamba" for i in range(num_layers)],
        position_embedding_type="rope" if use_rope else "nope",
        num_local_experts=experts,
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        shared_intermediate_size=int(shared) if shared else feed_forward,  # without experts: the dense MLP
    )
    return attention, moe


def _period_and_offset(layers: list[int], num_layers: int, what: str) -> tuple[int, int]:
    """(period, offset) of layers placed every ``period`` layers from ``offset``, as Jamba's config describes them."""
    if not layers:
        return num_layers + 1, num_layers  # none: an offset past the last layer
    period = layers[1] - layers[0] if len(layers) > 1 else num_layers
    if layers != list(range(layers[0], num_layers, period)):
        raise ValueError(f"a jamba file's {what} layers {layers} are not periodic, as Jamba's config needs them")
    return period, layers[0]


def _jamba_settings(reader, num_heads: int, hidden: int, num_layers: int, tensor_names: set[str]) -> tuple[dict, dict]:
    """Jamba's settings from a ``jamba`` file: attention layers from the per-layer KV head counts, expert layers
    from the tensors present, each as the period and offset Jamba's config takes; the Mamba1 mixers' sizes."""
    arch = "jamba"
    kv_heads = [int(h) for h in _field(reader, f"{arch}.attention.head_count_kv")]
    attention_period, attention_offset = _period_and_offset(
        [i for i, h in enumerate(kv_heads) if h > 0], num_layers, "attention"
    )
    expert_layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_exps.weight" in tensor_names]
    expert_period, expert_offset = _period_and_offset(expert_layers, num_layers, "expert")
    attention = dict(
        num_key_value_heads=max(kv_heads),
        attn_layer_period=attention_period,
        attn_layer_offset=attention_offset,
        mamba_d_state=int(_field(reader, f"{arch}.ssm.state_size")),
        mamba_d_conv=int(_field(reader, f"{arch}.ssm.conv_kernel")),
        mamba_expand=int(_field(reader, f"{arch}.ssm.inner_size")) // hidden,
        mamba_dt_rank=int(_field(reader, f"{arch}.ssm.time_step_rank")),
    )
    moe = dict(
        num_experts=int(_field(reader, f"{arch}.expert_count", 1) or 1),
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 1) or 1),
        expert_layer_period=expert_period,
        expert_layer_offset=expert_offset,
    )
    return attention, moe


def _yarn_settings(reader, arch: str) -> dict:
    """YaRN rotary scaling as transformers names it (llama.cpp keeps 0.1 * mscale_all_dim as ``yarn_log_multiplier``
    and assumes DeepSeek's mscale equal to it), or nothing where the file has no scaling."""
    if _field(reader, f"{arch}.rope.scaling.type") != "yarn":
        return {}
    mscale = float(_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    return {
        "rope_type": "yarn",
        "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
        "original_max_position_embeddings": int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
        "mscale": mscale,
        "mscale_all_dim": mscale,
        "beta_fast": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
    }


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
    # DeepSeek's latent attention and shared experts
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",  # rebuilt into kv_b_proj where the file lacks attn_kv_b
    "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# a Mamba2 mixer's tensors (granitehybrid)
_MAMBA2_NAMES = {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_out": "mamba.out_proj",
    "ssm_norm": "mamba.norm",
}
_MAMBA2_PARAMETERS = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt": "mamba.dt_bias"}  # no module
# names that differ per Hugging Face architecture (Granite's MLPs sit in its feed_forward block; Bamba's too)
_ARCH_LAYER_NAMES = {
    "GraniteMoeHybridForCausalLM": {
        "ffn_gate_shexp": "feed_forward.shared_mlp.gate_proj",
        "ffn_up_shexp": "feed_forward.shared_mlp.up_proj",
        "ffn_down_shexp": "feed_forward.shared_mlp.down_proj",
        "ffn_gate": "feed_forward.shared_mlp.gate_proj",  # no experts: the shared MLP is the layer's MLP
        "ffn_up": "feed_forward.shared_mlp.up_proj",
        "ffn_down": "feed_forward.shared_mlp.down_proj",
    },
    "JambaForCausalLM": {
        "ffn_norm": "pre_ff_layernorm",
        "ffn_gate": "feed_forward.gate_proj",
        "ffn_up": "feed_forward.up_proj",
        "ffn_down": "feed_forward.down_proj",
        "ssm_x": "mamba.x_proj",
        "ssm_dt": "mamba.dt_proj",  # Mamba1: the dt projection's weight and bias
        "ssm_a": "mamba.A_log",
        "ssm_dt_norm": "mamba.dt_layernorm",
        "ssm_b_norm": "mamba.b_layernorm",
        "ssm_c_norm": "mamba.c_layernorm",
    },
    "BambaForCausalLM": {
        "ffn_norm": "pre_ff_layernorm",
        "ffn_gate": "feed_forward.gate_proj",
        "ffn_up": "feed_forward.up_proj",
        "ffn_down": "feed_forward.down_proj",
    },
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_down_exps": 1, "ffn_up_exps": 2}  # index into the (gate, down, up) names


def _hf_name(gguf_name: str, hf_arch: str = "") -> str:
    """The Hugging Face name of a GGUF tensor; an expert tensor's names have ``{expert}`` in place of its index."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):  # a parameter of its own (a mixer's A and D)
        base, suffix = gguf_name, ""
    parts = base.split(".")
    if parts[0] == "blk":
        block, layer = parts[2], f"model.layers.{parts[1]}"
        renamed = _ARCH_LAYER_NAMES.get(hf_arch, {}).get(block)
        if renamed is None and block in _MAMBA2_PARAMETERS:
            return f"{layer}.{_MAMBA2_PARAMETERS[block]}"
        renamed = renamed or _MAMBA2_NAMES.get(block)
        if renamed:
            return f"{layer}.{renamed}" + (f".{suffix}" if suffix else "")
        module, experts = EXPERT_NAMES.get(hf_arch, DEFAULT_EXPERT_NAMES)
        if block == "ffn_gate_inp":
            return f"{layer}.{module}.gate.{suffix}"
        if block == "exp_probs_b":  # V3's correction bias of the expert scores
            return f"{layer}.{module}.gate.e_score_correction_bias"
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
    has_kv_b = any(t.name.endswith("attn_kv_b.weight") for t in reader.tensors)
    split_kv_b: dict[str, dict[str, np.ndarray]] = {}  # layer -> attn_k_b / attn_v_b, until both are read
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, hf_arch)
        if name.endswith(("k_b_proj.weight", "v_b_proj.weight")):
            if has_kv_b:  # the file has kv_b_proj itself
                continue
            layer, _, part = name.rpartition(".self_attn.")
            parts = split_kv_b.setdefault(layer, {})
            parts[part] = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if len(parts) == 2:
                yield (
                    f"{layer}.self_attn.kv_b_proj.weight",
                    _rebuild_kv_b(parts["k_b_proj.weight"], parts["v_b_proj.weight"]),
                )
            continue
        heads = None
        if permuted and name.endswith("q_proj.weight"):
            heads = hf_config.num_attention_heads
        elif permuted and name.endswith("k_proj.weight"):
            heads = hf_config.num_key_value_heads
        fmt = GGUF_TYPES.get(tensor.tensor_type.name)
        # the latent expansion stays float: its absorbed halves are multiplied into queries and outputs
        if fmt in keep_packed and tensor.data.ndim in (2, 3) and not name.endswith("kv_b_proj.weight"):
            blocks = tensor.data if heads is None else _unpermute_rotary(tensor.data, heads)
            for expert_name, rows in _per_expert(name, np.array(blocks, dtype=np.uint8)):
                cols = rows.shape[1] // BLOCK_BYTES[fmt] * QK
                yield expert_name, QuantizedWeight(fmt, (rows.shape[0], cols), torch.from_numpy(rows))
            continue
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if heads is not None:
            data = _unpermute_rotary(data, heads)
        data = _mamba2_parameter(name, np.array(data, dtype=np.float32))
        for expert_name, values in _per_expert(name, data):  # writable copies
            yield expert_name, torch.from_numpy(values)


def _mamba2_parameter(name: str, values: np.ndarray) -> np.ndarray:
    """A Mamba mixer's tensor in Hugging Face's shape: llama.cpp squeezes the conv1d weight to [channels, kernel],
    keeps A as -exp(A_log) (back to A_log here; Mamba2's [heads, 1], Mamba1's [channels, state]), Mamba2's D as
    [heads, 1] and its gated norm as [groups, width]."""
    if name.endswith("mamba.conv1d.weight"):
        return values.reshape(values.shape[0], 1, -1)
    if name.endswith("mamba.A_log"):
        a_log = np.log(-values)
        return a_log.reshape(-1) if a_log.shape[-1] == 1 else a_log
    if name.endswith(("mamba.D", "mamba.norm.weight")):
        return values.reshape(-1)
    return values


def _rebuild_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> torch.Tensor:
    """``kv_b_proj`` [heads * (nope + v), kv_lora_rank] from llama.cpp's ``attn_k_b`` [heads, kv_lora_rank, nope] (each
    head's key rows transposed) and ``attn_v_b`` [heads, v, kv_lora_rank]."""
    per_head = torch.cat([torch.from_numpy(k_b).transpose(1, 2), torch.from_numpy(v_b)], dim=1)
    return per_head.reshape(-1, per_head.shape[-1]).contiguous()


def _per_expert(name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """An expert tensor ``[experts, rows, ...]`` as one 2-D tensor per expert under its own name; others as they are."""
    if "{expert}" not in name:
        yield name, array
        return
    for expert, rows in enumerate(array):
        yield name.format(expert=expert), np.ascontiguousarray(rows)
