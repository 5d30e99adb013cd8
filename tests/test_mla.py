"""DeepSeek-V2 / V3 with multi-head latent attention against transformers on tiny random models: greedy parity with
chunked prefill, preemption, prefix-cache hits, async scheduling and tensor parallelism, on the cpu, torch and triton
backends; the latent cache's spec and shape; YaRN's rotary table; backends that cannot serve MLA say why."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.testing import inspect
from tests.helpers import (
    assert_all_blocks_free,
    assert_packed_gguf_within_top5,
    engine_greedy,
    hf_greedy,
    random_prompts,
    rounded_copy,
)

MAX_TOKENS = 12
PROMPTS = random_prompts(4, (6, 44), seed=31)
MLA_SHAPE = dict(
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
    head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_hidden_layers=2,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
FAMILIES = {
    # no q_lora_rank (q_proj), greedy softmax routing, interleaved rotary pairs
    "deepseek-v2": ("DeepseekV2Config", dict(MLA_SHAPE, q_lora_rank=None, topk_method="greedy")),
    # q_lora_rank (q_a_proj -> norm -> q_b_proj), YaRN with mscale, group-limited sigmoid routing
    "deepseek-v3": ("DeepseekV3Config", dict(MLA_SHAPE, q_lora_rank=24, n_group=2, topk_group=1, rope_parameters=YARN)),
}


_REFERENCES: dict = {}


def family_model(make_tiny_model, name: str):
    """(model folder, transformers model, transformers' greedy tokens of PROMPTS), made once per family."""
    if name not in _REFERENCES:
        config_cls, overrides = FAMILIES[name]
        model_dir = make_tiny_model(config_cls, **overrides)
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _REFERENCES[name] = (model_dir, hf_model, hf_greedy(hf_model, PROMPTS, MAX_TOKENS))
    return _REFERENCES[name]


@pytest.fixture(params=list(FAMILIES))
def family(request, make_tiny_model):
    return (request.param, *family_model(make_tiny_model, request.param))


CHUNKED = {"block_size": 8, "max_num_batched_tokens": 12}  # chunked prefill: chunks after cached latents
PREEMPT = {"num_gpu_blocks_override": 12, "block_size": 8, "max_model_len": 96}  # preemption and recompute
ASYNC = {"async_scheduling": True, "max_num_batched_tokens": 24}
REFERENCE = {"attention": "torch", "layer_kernels": "native"}  # the torch reference of MLA


@pytest.mark.parametrize(
    "name,config",
    [
        ("deepseek-v2", {}),
        ("deepseek-v2", PREEMPT),
        ("deepseek-v2", REFERENCE),
        ("deepseek-v3", {}),
        ("deepseek-v3", CHUNKED),
        ("deepseek-v3", PREEMPT),
        ("deepseek-v3", ASYNC),
        ("deepseek-v3", REFERENCE),
    ],
    ids=[
        "v2-default",
        "v2-preempt",
        "v2-torch-reference",
        "v3-default",
        "v3-chunked",
        "v3-preempt",
        "v3-async",
        "v3-torch-reference",
    ],
)
def test_mla_family_greedy_matches_transformers(make_tiny_model, name, config):
    model_dir, _, reference = family_model(make_tiny_model, name)
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, **config)
    assert tokens == reference, name
    if "num_gpu_blocks_override" in config:
        assert llm.get_stats().num_preemptions > 0
    llm.shutdown()


def test_mla_prefix_cache_hits_equal_the_cold_run(family):
    name, model_dir, hf_model, _ = family
    shared = random_prompts(1, (32, 32), seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(3, (2, 9), seed=6)]
    reference = hf_greedy(hf_model, prompts, 8)
    llm = LLM(model_dir, dtype="float32", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference, name
    assert llm.get_stats().prefix_cache_hits >= 5 * 32
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_mla_on_the_triton_backend_matches_transformers(make_tiny_model):
    """The interpreted Triton kernels decode over the latent cache (a short run: the interpreter is slow)."""
    model_dir, hf_model, _ = family_model(make_tiny_model, "deepseek-v3")
    prompts = PROMPTS[:2]
    tokens, llm = engine_greedy(model_dir, prompts, 6, attention="triton", max_num_batched_tokens=16)
    assert tokens == hf_greedy(hf_model, prompts, 6)
    llm.shutdown()


def test_mla_tensor_parallel_matches_transformers(make_tiny_model):
    """TP=2 splits the heads (q, kv_b and o projections); every rank caches the whole latent."""
    model_dir, hf_model, _ = family_model(make_tiny_model, "deepseek-v3")
    prompts = PROMPTS[:3]
    tokens, llm = engine_greedy(model_dir, prompts, MAX_TOKENS, tensor_parallel_size=2, max_num_batched_tokens=16)
    assert tokens == hf_greedy(hf_model, prompts, MAX_TOKENS)
    llm.shutdown()


def test_the_latent_cache_holds_one_row_per_token(make_tiny_model):
    """An MLA layer's cache is [blocks, block_size, kv_lora_rank + rope]: a page is a quarter of what per-head K/V
    of this model (4 heads of 24 + 16 dims) would take, so the same budget holds that many more blocks."""
    from engine.kv_cache.spec import MLAAttentionSpec

    config_cls, overrides = FAMILIES["deepseek-v2"]
    llm = LLM(make_tiny_model(config_cls, **overrides), dtype="float32", block_size=16, kv_cache_memory=2**20)
    runner = inspect(llm).model_runner
    specs = runner.get_kv_cache_spec()
    assert all(isinstance(spec, MLAAttentionSpec) for spec in specs.values()) and len(specs) == 2
    spec = next(iter(specs.values()))
    assert (spec.num_kv_heads, spec.head_size) == (1, 32 + 8)
    assert spec.page_size_bytes == 16 * 40 * 4
    layer = next(iter(runner.attention_layers.values()))
    num_blocks = llm.get_stats().num_total_blocks
    assert tuple(layer.kv_cache.shape) == (num_blocks, 16, 40)
    assert num_blocks == 2**20 // (2 * spec.page_size_bytes)  # two layers' pages per block
    llm.shutdown()


def test_a_backend_without_mla_is_refused_with_its_reason(make_tiny_model):
    config_cls, overrides = FAMILIES["deepseek-v2"]
    with pytest.raises(ConfigError, match="MLA"):
        LLM(make_tiny_model(config_cls, **overrides), attention="flash")


def test_yarn_rotary_table_matches_transformers():
    """DeepSeek's YaRN: the interpolated / extrapolated frequency blend and the cos / sin magnitude (attention factor),
    against transformers' rotary embedding."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    from engine.model.layers.rotary import RotaryEmbedding

    config = transformers.DeepseekV3Config(**dict(MLA_SHAPE, rope_parameters=YARN), max_position_embeddings=1024)
    hf_rope = modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    positions = torch.arange(0, 1024, 7)
    cos, sin = hf_rope(torch.zeros(1), positions[None])
    ours = RotaryEmbedding(8, 1024, 10000.0, YARN)
    torch.testing.assert_close(ours.table.cos[positions], cos[0].float())
    torch.testing.assert_close(ours.table.sin[positions][:, 4:], sin[0].float()[:, 4:])


def test_mla_in_bfloat16_stays_close_to_float32(family):
    """bfloat16 latents and absorbed products: the first greedy token of each prompt agrees with float32's."""
    name, model_dir, _, reference = family
    llm = LLM(model_dir, dtype="bfloat16")
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    first = [o.outputs[0].token_ids[0] for o in outputs]
    assert sum(a == r[0] for a, r in zip(first, reference)) >= len(PROMPTS) - 1, (name, first)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_int8_deepseek_matches_transformers_on_the_rounded_weights(family):
    """Weight-only int8 on DeepSeek: every projection (MLA's down projections included) and the routed and shared
    experts packed, the router and ``kv_b_proj`` (whose halves the absorbed decode folds into the query and the
    output) left float; with the native kernels greedy decoding equals transformers on the same int8-rounded weights."""
    from engine.model.layers.moe import moe_layers

    name, model_dir, hf_model, _ = family
    reference = hf_greedy(rounded_copy(hf_model, keep=("kv_b_proj.weight",)), PROMPTS, MAX_TOKENS)
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, quantization="int8", layer_kernels="native")
    assert tokens == reference, name
    model = inspect(llm).model
    assert all(layer.quant_w13 is not None for layer in moe_layers(model))
    assert getattr(model.model.layers[1].self_attn.kv_a_proj_with_mqa, "quant_weight", None) is not None
    llm.shutdown()


@pytest.mark.parametrize("projections", [None, "q8_0"], ids=["float-projections", "q8_0-projections"])
def test_a_deepseek2_gguf_file_matches_transformers(family, tokenizer_dir, tmp_path, projections):
    """A ``deepseek2`` GGUF file as llama.cpp's converter writes it (MLA as one KV head of the latent, ``kv_b_proj``
    split per head into ``attn_k_b`` and ``attn_v_b`` with no ``attn_kv_b``, V3's correction bias as ``exp_probs_b``,
    YaRN as a log multiplier), its experts Q8_0 blocks and, in a fully quantized file, its projections too: the engine
    reads DeepSeek-V2 or V3 from its metadata and, loaded de-quantized or with the blocks kept packed (native kernels),
    gives transformers' tokens on the same rounded weights; the packed rotary rows are reordered as the float ones."""
    from engine.model.layers.moe import moe_layers
    from engine.testing.models import write_moe_gguf

    name, _, hf_model, _ = family
    path = tmp_path / f"{name}.gguf"
    packed = write_moe_gguf(hf_model, path, "q8_0", projection_format=projections)
    assert bool(packed) == bool(projections)
    float_names = tuple(n for n, p in hf_model.named_parameters() if p.dim() == 2 and n not in packed)
    reference = hf_greedy(rounded_copy(hf_model, "q8_0", keep=float_names).eval(), PROMPTS, MAX_TOKENS)

    tokens, llm = engine_greedy(str(path), PROMPTS, MAX_TOKENS, tokenizer=tokenizer_dir, quantization="none")
    assert tokens == reference, name
    config = inspect(llm).model.config
    assert type(inspect(llm).model).__name__ == hf_model.config.architectures[0]
    mla_keys = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in (*mla_keys, "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor"):
        assert getattr(config, key) == getattr(hf_model.config, key), key
    llm.shutdown()
    tokens, llm = engine_greedy(
        str(path), PROMPTS, MAX_TOKENS, tokenizer=tokenizer_dir, quantization="gguf", layer_kernels="native"
    )
    assert tokens == reference, name
    model = inspect(llm).model
    assert all(layer.quant_w13 is not None and layer.quant_w13.format == "q8_0" for layer in moe_layers(model))
    attention = model.model.layers[1].self_attn
    assert (getattr(attention.kv_a_proj_with_mqa, "quant_weight", None) is not None) == bool(projections)
    assert_all_blocks_free(llm)
    llm.shutdown()
    assert_packed_gguf_within_top5(path, tokenizer_dir, PROMPTS, reference, MAX_TOKENS)
