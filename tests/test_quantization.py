"""Quantization methods end to end: which method ``auto`` picks and why others refuse, what stays packed in memory,
and greedy decoding with quantized weights against the de-quantized model (top-5 agreement at every step, the
way vLLM compares quantized models: once two greedy sequences part, each side's token must be in the other's
top-5 at that step, and the comparison of that sequence stops there)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, VllmConfig
from engine.interfaces.base import SelectionContext
from engine.model.model_info import resolve_model
from engine.plugins import get_plugin_manager
from engine.testing import inspect
from tests.helpers import assert_all_blocks_free


def _select(model=None, quantization="auto", **settings):
    config = VllmConfig.load(model=model, quantization=quantization, **settings)
    return get_plugin_manager().select(
        "quantization", quantization, SelectionContext(config, resolve_model(config.model))
    )


def test_auto_keeps_a_gguf_file_packed_where_the_kernels_serve_it(tiny_llama):
    """auto = gguf for a GGUF file under layer kernels that serve packed weights (cpu: single streams 2.5x faster,
    batches 0.88x, docs/benchmarks.md), none under those that would de-quantize every product (native); float
    checkpoints stay float."""
    cpu_built = (
        get_plugin_manager().implementations("layer_kernels")["cpu"].reasons(SelectionContext(VllmConfig.load())) == []
    )
    assert _select().name == ("gguf" if cpu_built else "none")  # the default model is a GGUF file
    assert _select(layer_kernels="native").name == "none"
    assert _select(quantization="gguf").name == "gguf"
    assert _select(tiny_llama).name == "none"
    assert _select(tiny_llama, "int8").name == "int8"
    with pytest.raises(
        ConfigError,
        match=r"model.quantization: quantization 'gguf' cannot run here: the model is not "
        r"a GGUF file.*Names that would work: \['int8', 'none', 'auto'\]",
    ):
        _select(tiny_llama, "gguf")
    with pytest.raises(ConfigError, match=r"unknown quantization 'awq'; choices: \['gguf', 'int8', 'none', 'auto'\]"):
        _select(tiny_llama, "awq")


def _top5_agreement(reference_outputs, outputs) -> tuple[int, int]:
    """(compared steps, sequences that parted); asserts top-5 agreement where they part."""
    steps, parted = 0, 0
    for ref, out in zip(reference_outputs, outputs):
        ref, out = ref.outputs[0], out.outputs[0]
        for position, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            steps += 1
            if a != b:
                assert a in out.logprobs[position] and b in ref.logprobs[position], (position, a, b)
                parted += 1
                break
    return steps, parted


def _teacher_forced_agreement(llm, prompts, reference_outputs) -> tuple[int, int]:
    """(positions where ``llm``'s most likely token is the reference's, positions scored): each prompt with the
    reference's generated tokens appended, scored by ``llm`` (prompt logprobs); asserts that every reference token is
    within ``llm``'s top 5 given the same prefix."""
    sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, reference_outputs)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    scored = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    agree = total = 0
    for prompt, sequence, output in zip(prompts, sequences, scored):
        for position in range(len(prompt), len(sequence)):
            rank = output.prompt_logprobs[position][sequence[position]].rank
            assert rank is not None and rank <= 5, (position, rank)
            agree += rank == 1
            total += 1
    return agree, total


def _generate(llm, prompts, steps):
    params = SamplingParams(temperature=0, max_tokens=steps, logprobs=5, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _quantized_modules(llm):
    model = inspect(llm).model
    return {name: m.quant_weight for name, m in model.named_modules() if getattr(m, "quant_weight", None) is not None}


@pytest.mark.parametrize("layer_kernels", ["cpu", "native"])
def test_int8_decodes_like_the_float_model(tiny_llama, layer_kernels):
    from engine.testing.models import random_prompts

    if layer_kernels == "cpu":
        pytest.importorskip("engine_attention_cpu._quant", reason="the cpu plugin's quantized kernels are not built")
    prompts = random_prompts(6, (8, 40), seed=3, vocab=(100, 1000))
    common = dict(model=tiny_llama, dtype="float32", layer_kernels=layer_kernels, kv_cache_memory="64MiB")
    reference = LLM(quantization="none", **common)
    expected = _generate(reference, prompts, 24)
    reference.shutdown()
    llm = LLM(quantization="int8", **common)
    packed = _quantized_modules(llm)
    assert packed and {w.format for w in packed.values()} == {"int8"}
    assert all(w.data.dtype == torch.int8 for w in packed.values())
    outputs = _generate(llm, prompts, 24)
    _top5_agreement(expected, outputs)  # a random tiny model's logits are close everywhere: sequences part early
    # the first step sees the same prompt: its logprobs within int8's error (weights and, in the cpu kernels,
    # activations rounded to int8 on a random model: about 0.15 at most here; a broken product is off by units)
    for ref, out in zip(expected, outputs):
        first_ref, first_out = ref.outputs[0].logprobs[0], out.outputs[0].logprobs[0]
        assert len(set(first_ref) & set(first_out)) >= 3
        for token_id in set(first_ref) & set(first_out):
            assert abs(first_ref[token_id].logprob - first_out[token_id].logprob) < 0.3
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.slow
def test_gguf_q4_1_keeps_blocks_packed_and_agrees_with_the_dequantized_model():
    """SmolLM2's Q4_1 GGUF: every linear weight and the tied Q8_0 embedding stay packed (no float copy), and greedy
    decoding on the packed weights agrees with the same file de-quantized at load on the parity prompts."""
    from engine.config import ModelConfig
    from engine.model.tokenizer import get_tokenizer
    from tests.test_parity_smollm2 import OTHERS, PREAMBLE, QUESTIONS

    tok = get_tokenizer(resolve_model(ModelConfig()))
    prompts = [tok.encode(PREAMBLE + q) for q in QUESTIONS] + [tok.encode(p) for p in OTHERS]
    common = dict(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)
    dequantized = LLM(quantization="none", **common)
    expected = _generate(dequantized, prompts, 32)
    dequantized.shutdown()
    llm = LLM(quantization="gguf", **common)
    packed = _quantized_modules(llm)
    assert {w.format for name, w in packed.items() if "layers" in name} == {"q4_1"}
    assert packed["model.embed_tokens"].format == "q8_0"
    assert len([n for n in packed if n.endswith("qkv_proj")]) == 30
    model = inspect(llm).model
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert float_bytes < 1 << 20  # only the norms remain float
    steps, parted = _top5_agreement(expected, _generate(llm, prompts, 32))
    # the activations are quantized to int8 in the products, as llama.cpp does: greedy sequences part where two
    # logits are close, always within each other's top-5. Where they part is chaotic (a change of 1e-6 in the
    # attention's sums moves a first step's logprobs by up to 0.09 through the int8 rounding), so the closeness is
    # measured teacher-forced: the packed model scores the de-quantized model's sequences token by token.
    agree, scored = _teacher_forced_agreement(llm, prompts, expected)
    print(
        f"gguf q4_1 against the de-quantized model: {parted} of {len(prompts)} greedy sequences parted "
        f"({steps} steps compared); teacher-forced top-1 agreement {agree} of {scored}"
    )
    assert agree >= 0.85 * scored
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.slow
def test_gguf_packed_shards_split_across_tensor_parallel_ranks():
    """TP=2 on packed Q4_1 / Q8_0 weights: each rank takes its rows (QKV by KV-head group, gate/up, the vocabulary)
    and whole blocks of columns (o_proj, down_proj); greedy decoding agrees with TP=1 within top-5 (the int8
    rounding of activations turns the partial sums' float reordering into rare near-tie swaps)."""
    prompts = [list(range(1000, 1016)), list(range(2000, 2040))]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(quantization="gguf", tensor_parallel_size=tp, kv_cache_memory="256MiB", max_model_len=1024)
        outputs[tp] = _generate(llm, prompts, 16)
        assert_all_blocks_free(llm)
        llm.shutdown()
    steps, _ = _top5_agreement(outputs[1], outputs[2])
    assert steps >= 5
