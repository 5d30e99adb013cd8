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
MAX_TOKENS = 64
PREAMBLE = ("You are a careful assistant for a small library in a coastal town. The library opens at nine, closes at "
            "six, lends books for three weeks, and charges no fines for children. Members may reserve up to five "
            "books, and the reading room is quiet after four in the afternoon. Answer the visitor briefly.\n")
QUESTIONS = ["Visitor: When does the library open?\nAssistant:", "Visitor: Do children pay fines?\nAssistant:",
             "Visitor: How many books can I reserve?\nAssistant:", "Visitor: Is the reading room quiet?\nAssistant:"]
OTHERS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived",
          "List three colors:"]


@pytest.fixture(scope="module")
def prompts(smollm2_gguf):
    from engine.model.model_info import resolve_model
    from engine.config import ModelConfig
    from engine.model.tokenizer import get_tokenizer

    tok = get_tokenizer(resolve_model(ModelConfig()))
    return [tok.encode(PREAMBLE + q) for q in QUESTIONS] + [tok.encode(p) for p in OTHERS]


@pytest.fixture(scope="module")
def reference(smollm2_gguf, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf),
                                                 gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32)
    return hf_greedy(model.eval(), prompts, MAX_TOKENS)


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 32},
    {"num_gpu_blocks_override": 24, "max_model_len": 384},
    {"enable_prefix_caching": False},
], ids=["default", "chunked-prefill", "preemption", "no-prefix-cache"])
def test_smollm2_greedy_equals_transformers(prompts, reference, config):
    llm = LLM(dtype="float32", **{"kv_cache_memory": "256MiB", "max_model_len": 2048, **config})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
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
