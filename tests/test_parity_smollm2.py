"""SmolLM2-135M-Instruct (the default model, GGUF) against transformers on the same weights, float32.

One transformers reference serves four engine runs: plain, chunked prefill, preemption, and no prefix
caching. Half of the prompts share a long prefix, so the plain run shows prefix-cache hits.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import assert_all_blocks_free, hf_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
PREAMBLE = (
    "You are a careful assistant for a small library in a coastal town. The library opens at nine, closes at "
    "six, lends books for three weeks, and charges no fines for children. Members may reserve up to five "
    "books, and the reading room is quiet after four in the afternoon. Answer the visitor briefly.\n"
)
QUESTIONS = [
    "Visitor: When does the library open?\nAssistant:",
    "Visitor: Do children pay fines?\nAssistant:",
    "Visitor: How many books can I reserve?\nAssistant:",
    "Visitor: Is the reading room quiet?\nAssistant:",
]
OTHERS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived",
    "List three colors:",
]


@pytest.fixture(scope="module")
def prompts(smollm2_gguf):
    from engine.config import ModelConfig
    from engine.model.model_info import resolve_model
    from engine.model.tokenizer import get_tokenizer

    tok = get_tokenizer(resolve_model(ModelConfig()))
    return [tok.encode(PREAMBLE + q) for q in QUESTIONS] + [tok.encode(p) for p in OTHERS]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    """transformers' own GGUF reader dequantizes the file. It parses the file once for the config and again for
    the tensors, and rebuilds gguf's name table for each of the 397 names it maps (under cProfile, 15 of the 23
    seconds the load took on 2 cores): the parse and the table are kept for the load. The weights are transformers'
    own, equal to a plain load's."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return hf_greedy(hf_model, prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 32},
        {"num_gpu_blocks_override": 24, "max_model_len": 384},
        {"enable_prefix_caching": False},
    ],
    ids=["default", "chunked-prefill", "preemption", "no-prefix-cache"],
)
def test_smollm2_greedy_equals_transformers(prompts, reference, config):
    llm = LLM(dtype="float32", quantization="none", **{"kv_cache_memory": "256MiB", "max_model_len": 2048, **config})
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == reference
    stats = llm.get_stats()
    if not config:
        assert stats.prefix_cache_hits >= 3 * 64, stats  # three followers reuse the long shared preamble
    if "num_gpu_blocks_override" in config:
        assert stats.num_preemptions > 0, stats
    if config.get("enable_prefix_caching") is False:
        assert stats.prefix_cache_hits == 0
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_smollm2_top5_logprobs_match_transformers(hf_model, prompts):
    """Greedy logprobs: our top-5 equal transformers' log-softmax to 1e-4 at every step."""
    steps = 16
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="256MiB", max_model_len=2048)
    chosen = [prompts[0], prompts[5]]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in chosen],
        SamplingParams(temperature=0, max_tokens=steps, logprobs=5, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, output in zip(chosen, outputs):
        ref = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=2,
        )
        completion = output.outputs[0]
        assert completion.token_ids == ref.sequences[0, len(prompt) :].tolist()
        for position, logits in zip(completion.logprobs, ref.logits):
            top = logits[0].float().log_softmax(-1).topk(5)
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(position[token_id].logprob - value) < 1e-4, (token_id, position[token_id], value)
    llm.shutdown()
