"""The captured decode step (``model.enforce_eager=false``): the ``cpu`` layer kernels replay a Llama-shaped model's
decoder-layer loop in C++ for pure decode steps, and every replayed step must give the eager step's bits, so the
tokens and logprobs of whole generations are compared for equality (not closeness) against ``enforce_eager``.
Steps the capture does not take (prompt chunks, mixed steps) run eagerly in the same engine; each row bucket of the
product choice has its own graph; models and settings it cannot run as the eager layers do are refused at start-up
with the reason."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import inspect
from engine.testing.models import random_prompts
from tests.helpers import assert_all_blocks_free

pytest.importorskip("engine_attention_cpu._graph", reason="the cpu plugin's decode graph is not built")


def _runner(llm):
    return inspect(llm).model_runner


def _generate(llm, prompts, max_tokens, seed=None):
    """Greedy rows and (with ``seed``) seeded sampled rows in one batch; lengths differ so the batch shrinks."""
    params = [
        SamplingParams(
            temperature=0 if seed is None or i % 2 else 0.8,
            seed=None if seed is None else seed + i,
            max_tokens=max_tokens - 6 * (i % 4),
            logprobs=3,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
        for o in outputs
    ]


def _eager_and_captured(model, prompts, max_tokens, seed=None, **settings):
    results, captured, preemptions = {}, {}, {}
    for enforce_eager in (True, False):
        llm = LLM(model=model, enforce_eager=enforce_eager, **settings)
        results[enforce_eager] = _generate(llm, prompts, max_tokens, seed)
        captured[enforce_eager] = _runner(llm).num_captured_steps
        preemptions[enforce_eager] = inspect(llm).scheduler.num_preemptions
        assert_all_blocks_free(llm)
        llm.shutdown()
    return results, captured, preemptions


@pytest.mark.parametrize(
    "settings",
    [
        dict(dtype="float32"),
        dict(dtype="bfloat16"),
        dict(dtype="float32", quantization="int8"),
        dict(dtype="float32", kv_cache_dtype="float16"),  # float32 rows written into, and read from, a 16-bit cache
        dict(dtype="float32", async_scheduling=True),
        dict(
            dtype="float32", num_gpu_blocks_override=14, max_model_len=128, max_num_batched_tokens=32
        ),  # preemption, chunked prompts
    ],
    ids=["float32", "bfloat16", "int8", "fp16-kv-cache", "async", "preemption"],
)
def test_captured_decode_gives_the_eager_bits(tiny_llama, settings):
    # 11 requests: the first decode steps hold more than the single-row bucket's 8 rows (the decode bucket's graph),
    # the later ones fewer (the single bucket's); prompts cross KV blocks; half the rows sample with seeds
    prompts = random_prompts(11, (5, 40), seed=5, vocab=(100, 1000))
    results, captured, preemptions = _eager_and_captured(
        tiny_llama, prompts, 30, seed=7, layer_kernels="cpu", kv_cache_memory="64MiB", **settings
    )
    assert captured[True] == 0 and captured[False] > 8
    if "num_gpu_blocks_override" in settings:
        assert preemptions[False] > 0
    else:  # every step after the prompts' is captured, those of 9-11 rows too (about 12 of 29 are under 9 rows)
        assert captured[False] > 20
    assert results[False] == results[True]


def test_a_qwen2_model_with_qkv_bias_is_captured_bit_exact(make_tiny_model):
    model = make_tiny_model("Qwen2Config")
    prompts = random_prompts(4, (6, 30), seed=2, vocab=(100, 1000))
    results, captured, preemptions = _eager_and_captured(
        model, prompts, 20, layer_kernels="cpu", dtype="float32", kv_cache_memory="64MiB"
    )
    assert captured[False] > 0
    assert results[False] == results[True]


@pytest.mark.parametrize(
    "case, settings, reason",
    [
        ("gemma2", dict(layer_kernels="cpu"), "not a Llama-shaped model"),
        ("qwen2-sliding", dict(layer_kernels="cpu"), "not in the first cache group"),
        ("llama", dict(layer_kernels="native"), "the 'native' layer kernels run the decode step eagerly"),
        ("llama", dict(layer_kernels="cpu", attention="torch"), "not this plugin's 'cpu' backend"),
    ],
)
def test_what_the_capture_cannot_run_as_the_eager_layers_do_stays_eager(
    make_tiny_model, caplog, case, settings, reason
):
    overrides = {
        "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
        "qwen2-sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        "llama": ("LlamaConfig", {}),
    }[case]
    model = make_tiny_model(overrides[0], **overrides[1])
    with caplog.at_level(logging.INFO, logger="engine.worker.model_runner"):
        llm = LLM(model=model, dtype="float32", kv_cache_memory="64MiB", **settings)
    assert _runner(llm).decode_step is None
    assert any("decode step not captured" in r.message and reason in r.message for r in caplog.records), [
        r.message for r in caplog.records
    ]
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert _runner(llm).num_captured_steps == 0
    llm.shutdown()


def test_enforce_eager_turns_the_capture_off(tiny_llama):
    llm = LLM(model=tiny_llama, layer_kernels="cpu", enforce_eager=True, kv_cache_memory="64MiB")
    assert _runner(llm).decode_step is None
    llm.shutdown()
    llm = LLM(model=tiny_llama, layer_kernels="cpu", kv_cache_memory="64MiB")
    assert _runner(llm).decode_step is not None and _runner(llm).decode_step.max_batch_size >= 256
    llm.shutdown()


@pytest.mark.slow
def test_smollm2_gguf_captured_decode_gives_the_eager_tokens():
    """The default model's Q4_1 file on the packed integer-dot products, on the parity prompts: the same tokens
    and logprobs with the captured step as with the eager one."""
    from engine.config import ModelConfig
    from engine.model.model_info import resolve_model
    from engine.model.tokenizer import get_tokenizer
    from tests.test_parity_smollm2 import OTHERS, PREAMBLE, QUESTIONS

    tok = get_tokenizer(resolve_model(ModelConfig()))
    prompts = [tok.encode(PREAMBLE + q) for q in QUESTIONS] + [tok.encode(p) for p in OTHERS]
    results, captured, preemptions = _eager_and_captured(
        None, prompts, 24, quantization="gguf", kv_cache_memory="256MiB", max_model_len=2048
    )
    assert captured[False] > 0
    assert results[False] == results[True]


def test_a_product_from_outside_the_plugin_is_called_back_in_the_captured_step(tiny_llama):
    """Where the measurement picks torch's product for a shape, the C++ loop calls that product back in Python:
    still the eager bits."""
    from engine.model.layers.gemm import PlainProduct

    llm = LLM(model=tiny_llama, layer_kernels="cpu", dtype="float32", kv_cache_memory="64MiB")
    runner = _runner(llm)
    for layer in runner.model.model.layers:
        layer.mlp.down_proj.packed = PlainProduct(layer.mlp.down_proj.weight, None, torch.float32)
    runner.decode_step = runner._capture_decode_step()
    assert runner.decode_step is not None
    prompts = random_prompts(3, (5, 20), seed=4, vocab=(100, 1000))
    captured = _generate(llm, prompts, 24)
    assert runner.num_captured_steps > 0
    runner.decode_step = None
    llm.reset_prefix_cache()
    assert _generate(llm, prompts, 24) == captured
    llm.shutdown()


def test_a_replayed_step_returns_a_tensor_the_next_replay_leaves_alone(tiny_llama):
    """The graph keeps its intermediate tensors from one replay to the next (as a CUDA graph keeps its buffers), but
    the hidden states a replay returns are the caller's: replaying other tokens, and other token counts, leaves them
    as they were, and the same tokens replayed again give them again."""
    llm = LLM(model=tiny_llama, layer_kernels="cpu", dtype="float32", kv_cache_memory="64MiB")
    runner = _runner(llm)
    graph = runner.decode_step.graphs[-1][1]
    hidden_size = runner.model.model.layers[0].input_layernorm.weight.shape[0]

    def replay(seed: int, tokens: int) -> torch.Tensor:
        hidden = torch.randn(tokens, hidden_size, generator=torch.Generator().manual_seed(seed))
        blocks = torch.arange(1, tokens + 1, dtype=torch.int32).view(tokens, 1)  # a block each, position 0
        return graph.run(
            hidden,
            torch.zeros(tokens, dtype=torch.int64),
            (blocks.view(-1) * runner.block_size).to(torch.int64),
            blocks,
            torch.ones(tokens, dtype=torch.int32),
        )

    first = replay(1, 1)
    kept = first.clone()
    second = replay(2, 1)
    assert second.data_ptr() != first.data_ptr()
    replay(3, 3)  # more tokens: the buffers grow
    assert torch.equal(first, kept)
    assert torch.equal(replay(1, 1), kept)
    assert torch.equal(replay(2, 1), second)
    llm.shutdown()
