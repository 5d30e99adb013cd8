"""The code in docs/plugins.md runs: every example defines what it says, and the small ones work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from engine.config import VllmConfig
from engine.interfaces.sampler import SamplingMetadata

DOC = Path(__file__).parent.parent / "docs" / "plugins.md"


@pytest.fixture(scope="module")
def examples() -> dict:
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        exec(compile(block, str(DOC), "exec"), namespace)  # in order, in one namespace, as the page reads
    return namespace


def test_every_example_defines_a_plugin_class(examples):
    from engine.interfaces.base import Pluggable

    names = {
        "MyKernelBackend",
        "ForceToken",
        "InlineExecutor",
        "GumbelSampler",
        "NeverHitCoordinator",
        "TanhSiluKernels",
        "MyLlamaForCausalLM",
        "DigitsOnly",
        "BucketResolver",
        "ThoughtBlock",
    }
    assert names <= set(examples)
    assert all(issubclass(examples[n], Pluggable) for n in names - {"MyLlamaForCausalLM"})


def test_the_sampler_example_samples_the_distribution_and_honours_seeds(examples):
    sampler = examples["GumbelSampler"](VllmConfig.load())
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5]).repeat(20000, 1)
    rows = len(logits)
    meta = SamplingMetadata(torch.full((rows,), 1.0), None, None, False, True)
    counts = torch.bincount(sampler(logits, meta).sampled_token_ids, minlength=6).double()
    expected = torch.softmax(logits[0].double(), dim=0) * rows
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    seeded = SamplingMetadata(
        torch.tensor([1.0, 0.0]),
        None,
        None,
        False,
        False,
        seeds=torch.tensor([7, 0]),
        seeded=torch.tensor([True, False]),
        output_index=torch.tensor([3, 0]),
    )
    first = sampler(logits[:2], seeded).sampled_token_ids
    assert first[1] == 0  # the greedy row
    assert all(sampler(logits[:2], seeded).sampled_token_ids[0] == first[0] for _ in range(5))


def test_the_layer_kernels_example_matches_native(examples):
    from engine.model.layers.native_kernels import NativeLayerKernels

    x = torch.randn(4, 16)
    torch.testing.assert_close(examples["TanhSiluKernels"]().silu_and_mul(x), NativeLayerKernels().silu_and_mul(x))


def test_the_structured_output_example_masks_and_ends(examples):
    import numpy as np

    from engine.sampling_params import StructuredOutputsParams

    class Tokenizer:
        def decode(self, ids):
            return {3: "7", 4: " 2", 5: "x"}.get(ids[0], "?")

    backend_cls = examples["DigitsOnly"]
    with pytest.raises(ValueError, match="only takes"):
        backend_cls.validate(StructuredOutputsParams(regex="[a-z]+"))
    with pytest.raises(ValueError, match="cannot express a json"):
        backend_cls.validate(StructuredOutputsParams(json={"type": "object"}))
    backend = backend_cls(VllmConfig.load(), Tokenizer(), 40, 39)
    matcher = backend.new_matcher(backend.compile_grammar(StructuredOutputsParams(regex="[0-9]{1,2}")))
    bitmask = np.zeros((1, 2), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(40) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [3, 4]  # digits only, no stop before the first
    assert matcher.accept_tokens([3, 4]) and not matcher.accept_tokens([5])
    matcher.fill_bitmask(bitmask, 0)
    assert [t for t in range(40) if bitmask[0, t // 32] >> (t % 32) & 1] == [39]
    assert matcher.accept_tokens([39]) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()


def test_the_resolver_example_finds_its_adapters(examples):
    import asyncio

    resolver = examples["BucketResolver"](VllmConfig.load())
    found = asyncio.run(resolver.resolve_lora("tiny", "sql"))
    assert found is not None and (found.lora_name, found.lora_path) == ("sql", "/srv/adapters/tiny-sql")
    assert asyncio.run(resolver.resolve_lora("tiny", "other")) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[thought]weigh it[/thought]Yes.", ("weigh it", "Yes.")),
        ("Just yes.", (None, "Just yes.")),
        ("[tho", (None, "[tho")),
    ],
)
def test_the_reasoning_parser_example_streams_what_it_splits(examples, text, expected):
    parser_cls = examples["ThoughtBlock"]
    assert parser_cls(None).extract_reasoning(text) == expected
    parser, reasoning, answer = parser_cls(None), "", ""
    for end in range(1, len(text) + 1):
        delta = parser.extract_reasoning_streaming(text[:end], end == len(text))
        reasoning += delta.reasoning_content or ""
        answer += delta.content or ""
    assert (reasoning or None, answer or None) == expected
