"""A logits processor asks for the requests it names, acts on their rows only, and treats each row on its
own (the same request gives the same row whatever its place in the batch)."""

from __future__ import annotations

import pytest
import torch

from engine.config import VllmConfig
from engine.interfaces.logits_processor import LogitsBatch
from engine.sampling_params import SamplingParams
from engine.testing.conformance.conftest import implementation
from engine.testing.conformance.plugin import logits_processor_params

# SamplingParams that make each built-in act; a third-party processor names its own (--engine-logits-processor-params)
BUILTIN_TRIGGERS = {
    "allowed_token_ids": {"allowed_token_ids": [3, 5, 7]},
    "bad_words": {"bad_words_token_ids": [[11], [12, 13]]},
    "logit_bias": {"logit_bias": {5: 10.0, 9: -3.0}},
    "min_tokens": {"min_tokens": 50, "max_tokens": 100, "stop_token_ids": [4]},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.3},
    "min_p": {"min_p": 0.2, "temperature": 0.8},
}
VOCAB = 64


@pytest.fixture
def processor_and_params(logits_processor_name, request):
    impl = implementation("logits_processor", logits_processor_name)
    kwargs = logits_processor_params(request.config) or BUILTIN_TRIGGERS.get(logits_processor_name)
    if kwargs is None:
        pytest.fail(
            f"say which SamplingParams make {logits_processor_name!r} act: --engine-logits-processor-params JSON"
        )
    return impl.create(VllmConfig.load()), SamplingParams(**kwargs)


def test_asks_only_for_the_requests_that_name_it(processor_and_params):
    processor, params = processor_and_params
    assert processor.requested_by(params)
    assert not processor.requested_by(SamplingParams())


def test_changes_only_the_rows_that_asked_and_each_row_alone(processor_and_params):
    processor, params = processor_and_params
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 11, 12, 5], [7, 7, 7]]
    outputs = [[12, 3, 9], [5]]
    logits = torch.randn(6, VOCAB, generator=gen)
    before = logits.clone()
    batch = LogitsBatch.from_requests([params, params], prompts, outputs, eos_token_id=2)
    batch.rows = torch.tensor([1, 4])
    processor.apply(logits, batch)
    untouched = [0, 2, 3, 5]
    assert torch.equal(logits[untouched], before[untouched]), "a row that did not ask was changed"
    assert logits.shape == before.shape and logits.dtype == before.dtype
    # the same two requests on rows 4 and 1 (swapped) give each request the same row as before
    swapped = before.clone()
    swapped[[4, 1]] = before[[1, 4]]
    batch = LogitsBatch.from_requests([params, params], prompts, outputs, eos_token_id=2)
    batch.rows = torch.tensor([4, 1])
    processor.apply(swapped, batch)
    torch.testing.assert_close(swapped[4], logits[1], rtol=0, atol=0)
    torch.testing.assert_close(swapped[1], logits[4], rtol=0, atol=0)
