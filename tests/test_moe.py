"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny random models: greedy
parity with chunked prefill, preemption, prefix-cache hits and async scheduling, under tensor parallelism and expert
parallelism; DeepSeek-V2/V3's MoE block against transformers' modules; expert placement, the combine, and the expert
load reported by get_stats() and /metrics."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.testing import inspect
from tests.helpers import (
    assert_all_blocks_free,
    assert_greedy_or_top5,
    engine_greedy,
    hf_greedy,
    random_prompts,
    rounded_copy,
)

MAX_TOKENS = 16
PROMPTS = random_prompts(5, (6, 50), seed=31)

FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # the shared expert with its sigmoid gate; layer 0 dense (mlp_only_layers), layer 1 sparse
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            num_hidden_layers=3,
        ),
    ),
    # renormalised top-k over 8 experts, every other layer sparse
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            num_hidden_layers=4,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, make_tiny_model):
    config_cls, overrides = FAMILIES[request.param]
    model_dir = make_tiny_model(config_cls, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, hf_model, hf_greedy(hf_model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"block_size": 8, "max_num_batched_tokens": 12},  # chunked prefill
        {"num_gpu_blocks_override": 12, "block_size": 8, "max_model_len": 96},  # preemption and recompute
        {"async_scheduling": True, "max_num_batched_tokens": 24},
        {"layer_kernels": "native"},  # the torch reference of the fused-MoE operation
    ],
    ids=["default", "chunked", "preempt", "async", "native-kernels"],
)
def test_moe_family_greedy_matches_transformers(family, config):
    name, model_dir, _, reference = family
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, **config)
    assert tokens == reference, name
    if "num_gpu_blocks_override" in config:
        assert llm.get_stats().num_preemptions > 0
    llm.shutdown()


def test_moe_prefix_cache_hits_equal_the_cold_run(family):
    name, model_dir, hf_model, _ = family
    shared = random_prompts(1, (32, 32), seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(3, (2, 9), seed=6)]
    reference = hf_greedy(hf_model, prompts, 8)
    llm = LLM(model_dir, dtype="float32", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference, name
    assert llm.get_stats().prefix_cache_hits >= 5 * 32  # two followers, then all three again
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_moe_tensor_and_expert_parallel_match_transformers(make_tiny_model, expert_parallel):
    """TP=2 shards each expert's intermediate dimension; EP=2 places whole experts (3 of 6 per rank) and sums the
    ranks' outputs; both give transformers' tokens (the shared expert and the dense layer are tensor-parallel)."""
    config_cls, overrides = FAMILIES["qwen2-moe"]
    model_dir = make_tiny_model(config_cls, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = PROMPTS[:3]
    tokens, llm = engine_greedy(
        model_dir,
        prompts,
        MAX_TOKENS,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=16,
    )
    assert tokens == hf_greedy(hf_model, prompts, MAX_TOKENS)
    load = llm.get_stats().expert_load
    assert sorted(load) == [1, 2] and all(len(counts) == 6 for counts in load.values())
    llm.shutdown()


def test_expert_parallel_ranks_hold_their_experts_and_their_outputs_sum_to_the_whole(monkeypatch):
    """Expert placement and the combine, one process: each of 2 EP ranks holds 3 of 6 experts (ids 0-2 and 3-5),
    skips the others' checkpoint tensors, and the two partial outputs add up to the single-rank output."""
    from engine.distributed import parallel_state
    from engine.interfaces.layer_kernels import MoERouting
    from engine.model.layers import moe

    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter = 6, 16, 12
    gate = torch.randn(experts, inter, hidden, generator=gen)
    up = torch.randn(experts, inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    routing = MoERouting(top_k=2, renormalize=True)

    def build(ep: parallel_state.GroupCoordinator) -> moe.FusedMoE:
        monkeypatch.setattr(moe, "get_ep_group", lambda: ep)
        layer = moe.FusedMoE(experts, hidden, inter, routing, layer_index=0)
        for e in range(experts):
            layer.weight_loader(layer.w13_weight, gate[e], "w1", e)
            layer.weight_loader(layer.w13_weight, up[e], "w3", e)
            layer.weight_loader(layer.w2_weight, down[e], "w2", e)
        return layer

    whole = build(parallel_state.GroupCoordinator())
    ranks = [build(parallel_state.GroupCoordinator(rank, 2)) for rank in range(2)]
    assert [r.num_local_experts for r in ranks] == [3, 3]
    assert torch.equal(ranks[1].w13_weight[0, :inter], gate[3]) and torch.equal(ranks[1].w2_weight[2], down[5])
    assert ranks[0].expert_map.tolist() == [0, 1, 2, -1, -1, -1]
    x, logits = torch.randn(9, hidden, generator=gen), torch.randn(9, experts, generator=gen)
    torch.testing.assert_close(ranks[0](x, logits) + ranks[1](x, logits), whole(x, logits))
    assert torch.equal(ranks[0].expert_load, whole.expert_load)  # every rank counts every expert's tokens
    assert int(whole.expert_load.sum()) == 9 * 2


def test_expert_load_counts_every_routed_token(family):
    name, model_dir, _, _ = family
    llm = LLM(model_dir, dtype="float32", enable_prefix_caching=False)
    prompts = PROMPTS[:2]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    # every prompt token and every generated token but the last passes each sparse layer once
    tokens = sum(len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outputs))
    config = inspect(llm).model.config
    top_k = config.num_experts_per_tok
    load = llm.get_stats().expert_load
    assert load, name
    for layer, counts in load.items():
        assert sum(counts) == tokens * top_k, (name, layer)
    if inspect(llm).plugins["layer_kernels"].name == "cpu":  # packed experts: the plain copy is released
        from engine.model.layers.moe import moe_layers

        layers = moe_layers(inspect(llm).model)
        assert layers and all(m.packed is not None and m.w13_weight.numel() == 0 for m in layers)
    llm.shutdown()


def test_int8_packs_the_experts_and_matches_transformers_on_the_rounded_weights(family, caplog):
    """Weight-only int8 quantizes the routed experts as it quantizes every linear layer (routers stay float, so a
    token's experts do not move with the rounding); the float experts are released. With the native kernels (products
    on the de-quantized weights) greedy decoding equals transformers on the same int8-rounded weights; the cpu
    kernels, which also round the activations per block of 32, agree with it within top-5 where they part."""
    from engine.model.layers.moe import moe_layers
    from engine.model.quant_formats import QuantizedExperts

    name, model_dir, hf_model, _ = family
    reference = hf_greedy(rounded_copy(hf_model), PROMPTS, MAX_TOKENS)
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, quantization="int8", layer_kernels="native")
    assert tokens == reference, name
    llm.shutdown()

    with caplog.at_level("INFO", logger="engine.quantization.methods"):
        llm = LLM(model_dir, dtype="float32", quantization="int8")
    model = inspect(llm).model
    layers = moe_layers(model)
    assert layers and f"the experts of {len(layers)} MoE layers kept packed (int8)" in caplog.text
    for layer in layers:
        assert isinstance(layer.quant_w13, QuantizedExperts) and layer.quant_w13.data.dtype == torch.int8
        assert layer.quant_w2 is not None and layer.quant_w2.shape[0] == layer.num_local_experts
        assert layer.w13_weight.numel() == 0 and layer.w2_weight.numel() == 0 and layer.packed is not None
    routers = [m for m in model.modules() if type(m).__name__ == "ReplicatedLinear"]
    assert routers and all(getattr(m, "quant_weight", None) is None for m in routers)
    assert_greedy_or_top5(llm, PROMPTS, reference, MAX_TOKENS)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_expert_load_reaches_prometheus():
    from prometheus_client import generate_latest

    from engine.entrypoints.openai.metrics import ServerMetrics
    from engine.messages import SchedulerStats

    metrics = ServerMetrics("m")
    stats = SchedulerStats(0, 0, 0.0, 10, 10, 0, 0, 0, expert_load={3: [5, 0, 2]})
    metrics.update_from_stats(stats)
    metrics.update_from_stats(SchedulerStats(0, 0, 0.0, 10, 10, 0, 0, 0, expert_load={3: [7, 1, 2]}))
    text = generate_latest(metrics.registry).decode()
    assert 'engine_moe_expert_tokens_total{dp_rank="0",expert="0",layer="3",model_name="m"} 7.0' in text
    assert 'engine_moe_expert_tokens_total{dp_rank="0",expert="1",layer="3",model_name="m"} 1.0' in text
    total = SchedulerStats.total([stats, SchedulerStats(0, 0, 0.0, 1, 1, 0, 0, 0, expert_load={3: [1, 1, 1]})])
    assert total.expert_load == {3: [6, 1, 3]}


def _hf_deepseek_moe(version: str, **overrides):
    import transformers

    settings = dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=100,
    )
    settings.update(overrides)
    config_cls = transformers.DeepseekV2Config if version == "v2" else transformers.DeepseekV3Config
    config = config_cls(**settings)
    module_name = "deepseek_v2.modeling_deepseek_v2" if version == "v2" else "deepseek_v3.modeling_deepseek_v3"
    module = __import__(f"transformers.models.{module_name}", fromlist=["x"])
    block = (module.DeepseekV2Moe if version == "v2" else module.DeepseekV3MoE)(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
        if version == "v3":
            block.gate.e_score_correction_bias.normal_(0, 0.3)  # a buffer: moves the choice, not the weights
    return config, block


@pytest.mark.parametrize(
    "version,overrides",
    [
        ("v2", dict(topk_method="greedy")),
        ("v2", dict(topk_method="group_limited_greedy")),
        ("v3", dict(norm_topk_prob=True)),
        ("v3", dict(norm_topk_prob=False)),
    ],
    ids=["v2-greedy", "v2-group-limited", "v3-normalised", "v3-unnormalised"],
)
@pytest.mark.parametrize("kernels_name", ["native", "cpu"])
def test_deepseek_moe_block_matches_transformers(version, overrides, kernels_name):
    """DeepSeek's MoE block (shared experts, grouped top-k, V3's sigmoid scores with the correction bias, the
    routed scaling factor) loaded from transformers' module gives its output, on the native and cpu kernels."""
    from engine.config import VllmConfig
    from engine.interfaces.base import SelectionContext
    from engine.model.deepseek import deepseek_mlp
    from engine.model.layers.kernels import use_layer_kernels
    from engine.plugins import get_plugin_manager

    config, hf_block = _hf_deepseek_moe(version, **overrides)
    impl = get_plugin_manager().implementations("layer_kernels")[kernels_name]
    if impl.reasons(SelectionContext(VllmConfig.load())):
        pytest.skip(f"the {kernels_name} layer kernels cannot run here")
    kernels = impl.cls()
    with use_layer_kernels(kernels):
        block = deepseek_mlp(config, layer_index=config.first_k_dense_replace)
    hf = hf_block.state_dict()
    with torch.no_grad():
        block.gate.weight.copy_(hf["gate.weight"])
        if version == "v3":
            block.experts.e_score_correction_bias.copy_(hf["gate.e_score_correction_bias"])
        block.experts.weight_loader(block.experts.w13_weight, hf["experts.gate_up_proj"], "w13")
        block.experts.weight_loader(block.experts.w2_weight, hf["experts.down_proj"], "w2")
        shared = block.shared_expert
        shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, hf["shared_experts.gate_proj.weight"], 0)
        shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, hf["shared_experts.up_proj.weight"], 1)
        shared.down_proj.weight.copy_(hf["shared_experts.down_proj.weight"])
    kernels.process_weights_after_loading(block, torch.float32, torch.device("cpu"))
    x = torch.randn(11, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf_block(x.unsqueeze(0)).squeeze(0), atol=1e-4, rtol=1e-4)
    assert int(block.experts.expert_load.sum()) == 11 * config.num_experts_per_tok


@pytest.mark.parametrize("name,fmt", [("qwen3-moe", "q8_0"), ("qwen3-moe", "q4_0"), ("mixtral", "q8_0")])
def test_a_gguf_moe_keeps_its_experts_packed_and_matches_transformers(
    make_tiny_model, tokenizer_dir, tmp_path, name, fmt
):
    """A ``qwen3moe`` GGUF file, or Mixtral's (``llama`` with experts, q/k rows permuted), with experts as 3-D Q8_0 /
    Q4_0 tensors as llama.cpp stores them: loaded in float it equals transformers on the same de-quantized experts;
    with ``quantization="gguf"`` the experts stay packed (no float copy) and the native kernels give the same tokens,
    the cpu kernels (activations rounded to int8 per block) agree within top-5 where they part."""
    from engine.model.layers.moe import moe_layers
    from engine.model.quant_formats import QuantizedExperts
    from engine.testing.models import write_moe_gguf

    config_cls, overrides = FAMILIES[name]
    hf_model = AutoModelForCausalLM.from_pretrained(make_tiny_model(config_cls, **overrides), dtype=torch.float32)
    path = tmp_path / f"{name}-{fmt}.gguf"
    write_moe_gguf(hf_model, path, fmt)
    reference = hf_greedy(rounded_copy(hf_model, fmt, experts_only=True).eval(), PROMPTS, MAX_TOKENS)

    tokens, llm = engine_greedy(str(path), PROMPTS, MAX_TOKENS, tokenizer=tokenizer_dir, quantization="none")
    assert tokens == reference
    llm.shutdown()
    tokens, llm = engine_greedy(
        str(path), PROMPTS, MAX_TOKENS, tokenizer=tokenizer_dir, quantization="gguf", layer_kernels="native"
    )
    assert tokens == reference
    llm.shutdown()

    llm = LLM(str(path), tokenizer=tokenizer_dir, dtype="float32", quantization="gguf")
    layers = moe_layers(inspect(llm).model)
    sparse = [1, 3] if name == "qwen3-moe" else list(range(hf_model.config.num_hidden_layers))
    assert [m.layer_index for m in layers] == sparse  # the file's dense layers stay dense
    for layer in layers:
        assert isinstance(layer.quant_w13, QuantizedExperts) and layer.quant_w13.format == fmt
        assert layer.w13_weight.numel() == 0 and layer.w2_weight.numel() == 0
    assert_greedy_or_top5(llm, PROMPTS, reference, MAX_TOKENS)
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_packed_gguf_experts_split_over_two_ranks(make_tiny_model, tokenizer_dir, tmp_path, expert_parallel):
    """Mixtral's Q8_0 experts from a GGUF file stay packed on each of 2 ranks: TP=2 gives each rank its rows of gate
    and up and whole blocks of down's columns, EP=2 two whole experts each; both give transformers' tokens on the
    same de-quantized experts (native kernels: products on the de-quantized weights)."""
    from engine.testing.models import write_moe_gguf

    config_cls, overrides = FAMILIES["mixtral"]
    hf_model = AutoModelForCausalLM.from_pretrained(make_tiny_model(config_cls, **overrides), dtype=torch.float32)
    path = tmp_path / "mixtral-q8_0.gguf"
    write_moe_gguf(hf_model, path, "q8_0")
    prompts = PROMPTS[:3]
    tokens, llm = engine_greedy(
        str(path),
        prompts,
        MAX_TOKENS,
        tokenizer=tokenizer_dir,
        quantization="gguf",
        layer_kernels="native",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    assert tokens == hf_greedy(rounded_copy(hf_model, "q8_0", experts_only=True).eval(), prompts, MAX_TOKENS)
    llm.shutdown()
