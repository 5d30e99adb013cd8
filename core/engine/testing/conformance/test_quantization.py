"""A quantization method keeps the model's answers: the weights it packs de-quantize close to the float ones, and
greedy decoding agrees with the float model (top-5 agreement where two greedy sequences part)."""

from __future__ import annotations

from engine.testing import inspect
from engine.testing.conformance.conftest import implementation


def _model(llm):
    return inspect(llm).model


def test_quantized_weights_and_greedy_decoding_stay_close(quantization_name, tiny_model):
    from engine import LLM, SamplingParams
    from engine.model.quant_formats import QuantizedWeight, dequantize

    implementation("quantization", quantization_name, model=tiny_model)
    common = dict(model=tiny_model, dtype="float32", kv_cache_memory="64MiB", executor="uniproc")
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(12)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    reference = LLM(quantization="none", **common)
    floats = {
        name: m.weight.detach().clone()
        for name, m in _model(reference).named_modules()
        if hasattr(m, "weight") and getattr(m.weight, "dim", lambda: 0)() == 2
    }
    expected = reference.generate(prompts, params, use_tqdm=False)
    reference.shutdown()
    llm = LLM(quantization=quantization_name, **common)
    for name, module in _model(llm).named_modules():
        packed = getattr(module, "quant_weight", None)
        if packed is None or name not in floats:
            continue
        assert isinstance(packed, QuantizedWeight) and packed.shape == tuple(floats[name].shape), name
        error = (dequantize(packed) - floats[name]).abs().max().item()
        assert error <= 0.2 * floats[name].abs().max().item(), (name, error)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ref, out in zip(expected, outputs):
        for position, (a, b) in enumerate(zip(ref.outputs[0].token_ids, out.outputs[0].token_ids)):
            if a != b:
                assert a in out.outputs[0].logprobs[position] and b in ref.outputs[0].logprobs[position]
                break
    llm.shutdown()
