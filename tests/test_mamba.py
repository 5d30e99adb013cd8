"""Mamba hybrids against transformers on tiny random models: greedy parity with chunked prefill, preemption and
async scheduling; the Mamba state's place in the KV cache (one block per request, two while a step moves it into a
new block, pages shared with attention); prefix caching of the states at block boundaries; the kernels' torch
reference against the plain recurrence."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.single_type_manager import MambaManager
from engine.kv_cache.spec import FullAttentionSpec, MambaSpec
from engine.model.layers import mamba_reference
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
BAMBA = dict(
    num_hidden_layers=4,
    attn_layer_indices=[1],
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=8,  # prompts span several scan chunks
    mamba_expand=1,
)
GRANITE = dict(
    {key: value for key, value in BAMBA.items() if key != "attn_layer_indices"},
    mamba_n_groups=1,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=96,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,
    logits_scaling=2.0,
)
FAMILIES = {
    "bamba": ("BambaConfig", BAMBA),
    # Granite 4.0-H: MoE and a shared MLP after every mixer, Granite's multipliers, no positional embedding
    "granite-4.0-h": ("GraniteMoeHybridConfig", dict(GRANITE, position_embedding_type="nope")),
    "granite-rope": ("GraniteMoeHybridConfig", dict(GRANITE, position_embedding_type="rope", num_local_experts=0)),
    # Mamba1 (per-channel decays, normed dt / B / C) with attention at layer 1 and MoE on odd layers
    "jamba": (
        "JambaConfig",
        dict(
            num_hidden_layers=4,
            attn_layer_period=4,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_expand=1,
            mamba_dt_rank=8,
        ),
    ),
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


def engine_greedy_again(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of ``prompts`` on an engine already running (all KV blocks back after)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outputs]


# a Mamba state (3200 bytes) is more than an 8-token attention page (2048): the block size is raised to 16
CHUNKED = {"max_num_batched_tokens": 12, "block_size": 8}  # prompts in chunks: the state carries across them
PREEMPT = {"num_gpu_blocks_override": 13, "block_size": 8, "max_model_len": 96}  # restarts from a reset state
ASYNC = {"async_scheduling": True, "max_num_batched_tokens": 24}
REFERENCE = {"attention": "torch", "layer_kernels": "native"}


@pytest.mark.parametrize(
    "name,config",
    [
        ("bamba", {}),
        ("bamba", CHUNKED),
        ("bamba", PREEMPT),
        ("bamba", ASYNC),
        ("bamba", REFERENCE),
        ("granite-4.0-h", {}),
        ("granite-4.0-h", PREEMPT),
        ("granite-rope", {}),
        ("jamba", {}),
        ("jamba", CHUNKED),
        ("jamba", PREEMPT),
    ],
    ids=[
        "bamba-default",
        "bamba-chunked",
        "bamba-preempt",
        "bamba-async",
        "bamba-torch-reference",
        "granite-default",
        "granite-preempt",
        "granite-rope-dense",
        "jamba-default",
        "jamba-chunked",
        "jamba-preempt",
    ],
)
def test_hybrid_family_greedy_matches_transformers(make_tiny_model, name, config):
    model_dir, _, reference = family_model(make_tiny_model, name)
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, **config)
    assert tokens == reference, name
    if "num_gpu_blocks_override" in config:
        assert llm.get_stats().num_preemptions > 0
    llm.shutdown()


def test_a_mamba_layer_holds_at_most_two_blocks_per_request_whatever_its_length(make_tiny_model):
    """Three Mamba layers and one attention layer: four KV-cache groups of one layer over one shared tensor. The
    attention block size is raised so that a page holds a Mamba state; while requests run, each Mamba group holds
    one block per request, two in a step that moves the state into a new block (the one it reads and the one it
    writes), and the attention group one per block_size tokens; every block returns at the end."""
    model_dir, _, reference = family_model(make_tiny_model, "bamba")
    llm = LLM(model_dir, dtype="float32", block_size=8)
    config = inspect(llm).engine_core.kv_cache_config
    kinds = [type(group.spec) for group in config.groups]
    assert kinds.count(MambaSpec) == 3 and kinds.count(FullAttentionSpec) == 1
    mamba = next(group.spec for group in config.groups if isinstance(group.spec, MambaSpec))
    attention = next(group.spec for group in config.groups if isinstance(group.spec, FullAttentionSpec))
    # conv state [conv_dim = 64 + 2 * 2 * 8, K - 1 = 3] and SSM state [4 heads, 16, 8], float32: 3200 bytes
    assert mamba.state_size_bytes == (96 * 3 + 4 * 16 * 8) * 4
    # an 8-token attention page (K and V of 2 heads of 16, float32) is 2048 bytes: raised to 16 tokens, 4096
    assert attention.block_size == 16 and attention.page_size_bytes == 4096
    assert mamba.page_size_bytes == 4096 and len(config.shared_tensors()) == 1

    runner = inspect(llm).model_runner
    managers = inspect(llm).kv_cache_manager.coordinator.managers
    null_block = inspect(llm).kv_cache_manager.block_pool.null_block
    held = []  # per step: (Mamba blocks each request holds, whether its step crosses into a new block)
    step_usage = []  # per step: (blocks held, peak) of every group
    original = runner.execute_model

    def spy(scheduler_output):
        step_usage.append(inspect(llm).kv_cache_manager.group_block_usage())
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            end = inspect(llm).scheduler.requests[request_id].num_computed_tokens  # the step's tokens count already
            start = end - num_scheduled
            crosses = start > 0 and (start - 1) // 16 != (end - 1) // 16
            for manager in managers:
                if isinstance(manager.spec, MambaSpec):
                    blocks = manager.req_to_blocks[request_id]
                    held.append((sum(block is not null_block for block in blocks), crosses))
        return original(scheduler_output)

    runner.execute_model = spy
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert {count for count, crosses in held if not crosses} == {1}
    assert {count for count, crosses in held if crosses} == {2}
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    for group_id, group in enumerate(config.groups):
        if not isinstance(group.spec, MambaSpec):
            peak = max(usage[group_id][0] for usage in step_usage)
            assert len(PROMPTS) <= peak <= len(PROMPTS) * -(-longest // group.spec.block_size)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_a_mamba_state_is_cached_only_where_a_step_ended_at_the_block_end():
    """The Mamba group's bookkeeping on its own (blocks of 4 tokens): a step that ends at a block's end leaves that
    block's state, cached from the request's next step on; a block whose step ended inside it, then moved on, holds
    the state of an earlier position and is never cached; a hit needs only its last block cached."""
    spec = MambaSpec(4, ((2, 3),), torch.float32)
    pool = BlockPool(12, reserve_null_block=True)
    manager = MambaManager(spec, pool, enable_caching=True)
    null = pool.null_block
    hashes = [bytes([i]) * 8 for i in range(4)]

    def step(request_id: str, computed: int, end: int) -> list:
        manager.remove_skipped_blocks(request_id, computed)
        assert manager.get_num_blocks_to_allocate(request_id, end, []) <= 1
        new = manager.allocate_new_blocks(request_id, end)
        manager.cache_blocks(request_id, hashes, end)
        return new

    # "a": 0 -> 6 (mid block 1) -> 8 (the end of block 1: the state in block 1 is the block's) -> 9 -> 10
    assert step("a", 0, 6)[:1] == [null] and len(step("a", 6, 8)) == 0
    assert manager.find_longest_cache_hit(hashes, 15) == []  # not while the step that writes it is planned
    assert len(step("a", 8, 9)) == 1  # the state moves into block 2; block 1 is cached now
    hit = manager.find_longest_cache_hit(hashes, 15)
    assert hit[:1] == [null] and hit[1] is manager.req_to_blocks["a"][1] and len(hit) == 2
    step("a", 9, 10)  # block 1 goes back to the pool, still cached
    assert [b is not null for b in manager.req_to_blocks["a"]] == [False, False, True]
    assert manager.find_longest_cache_hit(hashes, 15)[1].ref_cnt == 0
    manager.free("a")

    # "b" with other tokens: 0 -> 6 -> 13 moves on from block 1 (its state is position 6's): nothing is cached
    pool.reset_prefix_cache()
    step("b", 0, 6)
    step("b", 6, 13)
    step("b", 13, 14)
    assert manager.find_longest_cache_hit(hashes, 15) == []
    assert manager.num_held_blocks == 1
    manager.free("b")
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.mark.parametrize("config", [{}, CHUNKED], ids=["one-step", "chunked"])
def test_repeated_prompts_resume_from_the_cached_mamba_states(make_tiny_model, config):
    """Prefix caching on a hybrid: each prompt's chunks end at block boundaries, so the state after its last whole
    block is cached; run again, every prompt resumes there and the tokens stay transformers'. Copies sent with the
    originals are admitted in the step that writes those states (one-step) and must not read them before they are
    written, or behind the originals (chunked) and hit them."""
    model_dir, _, reference = family_model(make_tiny_model, "bamba")
    llm = LLM(model_dir, dtype="float32", **config)
    block_size = inspect(llm).kv_cache_manager.block_size
    assert engine_greedy_again(llm, PROMPTS + PROMPTS, MAX_TOKENS) == reference + reference
    first_hits = llm.get_stats().prefix_cache_hits
    assert engine_greedy_again(llm, PROMPTS, MAX_TOKENS) == reference
    # the second run hits every prompt's last whole block before its final token
    expected = sum((len(p) - 1) // block_size * block_size for p in PROMPTS)
    assert llm.get_stats().prefix_cache_hits - first_hits == expected
    llm.shutdown()


@pytest.mark.parametrize("name,config", [("bamba", {}), ("jamba", ASYNC), ("granite-4.0-h", PREEMPT)])
def test_a_follow_up_turn_resumes_from_a_state_cached_while_decoding(make_tiny_model, name, config):
    """A second turn (prompt, the answer, then more tokens) resumes from the state the first turn's decode left at
    a block boundary past its prompt, and its tokens are transformers' for the whole conversation."""
    model_dir, hf_model, _ = family_model(make_tiny_model, name)
    llm = LLM(model_dir, dtype="float32", **config)
    block_size = inspect(llm).kv_cache_manager.block_size
    prompt = random_prompts(1, (block_size + 4, block_size + 4), seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=block_size + 8)  # decode passes the boundary at 2 blocks
    answer = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    follow_up = prompt + list(answer) + random_prompts(1, (5, 5), seed=6)[0]
    hits_before = llm.get_stats().prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = llm.generate([{"prompt_token_ids": follow_up}], params, use_tqdm=False)
    assert tokens[0].outputs[0].token_ids == hf_greedy(hf_model, [follow_up], 8)[0]
    assert llm.get_stats().prefix_cache_hits - hits_before == 2 * block_size
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_prefix_caching_off_recomputes_every_prompt(make_tiny_model):
    model_dir, _, reference = family_model(make_tiny_model, "bamba")
    llm = LLM(model_dir, dtype="float32", enable_prefix_caching=False)
    assert inspect(llm).plugins["kv_cache_coordinator"].name == "no_prefix"
    for _ in range(2):  # the same prompts twice: recomputed, same tokens
        assert engine_greedy_again(llm, PROMPTS, MAX_TOKENS) == reference
    assert llm.get_stats().prefix_cache_hits == 0
    llm.shutdown()


def test_pipeline_parallel_hybrid_matches_transformers(make_tiny_model):
    """PP=2: each stage binds and carries the states of its own Mamba layers."""
    model_dir, _, reference = family_model(make_tiny_model, "jamba")
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, pipeline_parallel_size=2, max_num_batched_tokens=16)
    assert tokens == reference
    llm.shutdown()


@pytest.mark.parametrize("name", ["bamba", "jamba"])
def test_int8_weights_run_the_hybrids(make_tiny_model, name):
    """Weight-only int8 quantizes the Mamba projections too (in_proj, x_proj, dt_proj, out_proj): the first greedy
    token of most prompts stays the float model's."""
    model_dir, _, reference = family_model(make_tiny_model, name)
    tokens, llm = engine_greedy(model_dir, PROMPTS, 4, quantization="int8")
    assert sum(t[0] == r[0] for t, r in zip(tokens, reference)) >= len(PROMPTS) - 1, (name, tokens)
    llm.shutdown()


def test_speculative_decoding_is_refused_by_name(make_tiny_model):
    model_dir, _, _ = family_model(make_tiny_model, "bamba")
    with pytest.raises(ConfigError, match="speculative.method='ngram'"):
        LLM(model_dir, dtype="float32", speculative_config={"method": "ngram"})


@pytest.mark.parametrize("name", ["bamba", "granite-4.0-h", "jamba"])
def test_tensor_parallel_hybrids_match_transformers(make_tiny_model, name):
    """TP=2 splits the Mamba heads (Bamba: two groups, one per rank; Granite: one group, whole on both ranks, its
    gated norm summed over them; Jamba: the channels, x_proj's product summed), the attention heads and the experts'
    intermediate dimension; each rank keeps its share of every state, and a second run resumes from the cached
    shares."""
    model_dir, _, reference = family_model(make_tiny_model, name)
    tokens, llm = engine_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, max_num_batched_tokens=16)
    assert tokens == reference, name
    hits = llm.get_stats().prefix_cache_hits
    assert engine_greedy_again(llm, PROMPTS, MAX_TOKENS) == reference, name
    assert llm.get_stats().prefix_cache_hits > hits
    llm.shutdown()


# ---- the kernels' torch reference ------------------------------------------------------------------------------


def plain_recurrence(x, dt, A, B, C, D, dt_bias, state):
    """Mamba2 one token at a time, in float64: h = exp(dt A) h + dt x B^T, y = h C + D x."""
    heads, groups = x.shape[1], B.shape[1]
    step = torch.nn.functional.softplus(dt.double() + dt_bias.double())
    b = B.double().repeat_interleave(heads // groups, dim=1)
    c = C.double().repeat_interleave(heads // groups, dim=1)
    h = state.double().clone()
    ys = []
    for t in range(x.shape[0]):
        h = (
            h * torch.exp(step[t] * A.double())[:, None, None]
            + (step[t][:, None] * x[t].double())[..., None] * b[t][:, None, :]
        )
        ys.append(torch.einsum("hpn,hn->hp", h, c[t]) + D.double()[:, None] * x[t].double())
    return torch.stack(ys), h


def scan_case(lengths, heads=4, head_dim=8, groups=2, state=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, generator=gen)
    dt = torch.randn(total, heads, generator=gen)
    B = torch.randn(total, groups, state, generator=gen)
    C = torch.randn(total, groups, state, generator=gen)
    A = -torch.rand(heads, generator=gen) * 2
    D = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen) * 0.5
    states = torch.randn(len(lengths), heads, head_dim, state, generator=gen)
    return x, dt, A, B, C, D, dt_bias, states


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_the_chunked_scan_equals_the_plain_recurrence(chunk_size):
    """Requests of 1 (the single-step update), 5, 13 and 20 tokens, each from its own state, in one call."""
    lengths = [5, 1, 13, 20, 1]
    x, dt, A, B, C, D, dt_bias, states = scan_case(lengths)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    expected = [
        plain_recurrence(*(t[s:e] for t in (x, dt)), A, *(t[s:e] for t in (B, C)), D, dt_bias, states[i])
        for i, (s, e) in enumerate(zip(starts[:-1], starts[1:]))
    ]
    ssm_state = states.clone()
    y = mamba_reference.mamba2_scan(x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), ssm_state, starts, chunk_size)
    for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        torch.testing.assert_close(y[s:e].double(), expected[i][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ssm_state[i].double(), expected[i][1], rtol=1e-4, atol=1e-4)


def test_a_scan_split_anywhere_carries_its_state():
    """One request run in three calls (as chunked prefill then decode runs it) equals one call over all of it."""
    x, dt, A, B, C, D, dt_bias, states = scan_case([24])
    limit = (0.0, float("inf"))
    whole_state = states.clone()
    whole = mamba_reference.mamba2_scan(x, dt, A, B, C, D, dt_bias, limit, whole_state, [0, 24], 8)
    state = states.clone()
    parts = []
    for s, e in [(0, 11), (11, 23), (23, 24)]:
        parts.append(
            mamba_reference.mamba2_scan(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, dt_bias, limit, state, [0, e - s], 8)
        )
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)


def test_the_causal_convolution_carries_its_last_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(30, 6, generator=gen)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    full = torch.nn.functional.conv1d(x.T[None], weight[:, None], bias, padding=3, groups=6)[0, :, :30].T
    expected = torch.nn.functional.silu(full)
    state = torch.zeros(1, 6, 3)
    parts = [
        mamba_reference.causal_conv1d(x[s:e], weight, bias, state, [0, e - s]) for s, e in [(0, 2), (2, 17), (17, 30)]
    ]
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], x[-3:].T)


def test_the_mamba1_scan_runs_each_request_from_its_own_state():
    """Requests of 3, 1 and 6 tokens in one call equal each request alone, in float64, from its own state."""
    gen = torch.Generator().manual_seed(2)
    lengths, channels, state_size = [3, 1, 6], 5, 4
    total = sum(lengths)
    x, z, dt = (torch.randn(total, channels, generator=gen) for _ in range(3))
    B, C = (torch.randn(total, state_size, generator=gen) for _ in range(2))
    A = -torch.rand(channels, state_size, generator=gen)
    D, dt_bias = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
    states = torch.randn(len(lengths), channels, state_size, generator=gen)
    starts = [0, 3, 4, 10]
    ssm_state = states.clone()
    y = mamba_reference.selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, starts)
    for row in range(len(lengths)):
        h = states[row].double()
        for t in range(starts[row], starts[row + 1]):
            step = torch.nn.functional.softplus(dt[t].double() + dt_bias.double())
            h = torch.exp(step[:, None] * A.double()) * h + (step * x[t].double())[:, None] * B[t].double()
            expected = (h @ C[t].double() + D.double() * x[t].double()) * torch.nn.functional.silu(z[t].double())
            torch.testing.assert_close(y[t].double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm_state[row].double(), h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["granite-4.0-h", "bamba", "jamba"])
def test_a_hybrid_gguf_file_matches_transformers(make_tiny_model, tokenizer_dir, tmp_path, name):
    """A ``granitehybrid`` GGUF file as llama.cpp's converter writes Granite 4.0-H and Bamba, or a ``jamba`` one (KV
    heads per layer, 0 for a mixer; A as -exp(A_log), D and the gated norm reshaped, conv1d squeezed; Granite's q/k
    rows interleaved and its multipliers; experts as 3-D Q8_0 blocks): the engine reads back the family, its layer
    types and its mixers' sizes, and gives transformers' tokens on the same rounded experts, loaded de-quantized or
    with the experts kept packed (native kernels; the cpu kernels within the top 5)."""
    from engine.testing.models import write_hybrid_gguf

    _, hf_model, _ = family_model(make_tiny_model, name)
    path = tmp_path / f"{name}.gguf"
    write_hybrid_gguf(hf_model, path, "q8_0")
    reference = hf_greedy(rounded_copy(hf_model, "q8_0", experts_only=True).eval(), PROMPTS, MAX_TOKENS)
    for quantization in ("none", "gguf"):
        tokens, llm = engine_greedy(
            str(path), PROMPTS, MAX_TOKENS, tokenizer=tokenizer_dir, quantization=quantization, layer_kernels="native"
        )
        assert tokens == reference, (name, quantization)
        model = inspect(llm).model
        assert type(model).__name__ == hf_model.config.architectures[0]
        config = model.config
        mixer = ("mamba_dt_rank",) if name == "jamba" else ("mamba_n_heads", "mamba_n_groups")
        for key in (*mixer, "mamba_d_state", "mamba_d_conv", "mamba_expand"):
            assert getattr(config, key) == getattr(hf_model.config, key), key
        if name == "jamba":
            assert config.layers_block_type == hf_model.config.layers_block_type
            assert (config.expert_layer_period, config.expert_layer_offset) == (2, 1)
        elif name == "bamba":
            assert config.attn_layer_indices == hf_model.config.attn_layer_indices
        else:
            assert config.layer_types == hf_model.config.layer_types
            assert config.embedding_multiplier == hf_model.config.embedding_multiplier
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert_packed_gguf_within_top5(path, tokenizer_dir, PROMPTS, reference, MAX_TOKENS)
