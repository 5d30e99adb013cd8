"""The default sampler and the built-in logits processors on fixed distributions (statistical tests)."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from engine.config import VllmConfig
from engine.interfaces.logits_processor import LogitsRequestView
from engine.interfaces.sampler import SamplingMetadata
from engine.sample.builtin_logits_processors import MinPLogitsProcessor
from engine.sample.default_sampler import DefaultSampler
from engine.sampling_params import SamplingParams

ROWS = 20000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def sample(temperature=1.0, top_k=None, top_p=None, rows=ROWS, generators=None):
    logits = LOGITS.repeat(rows, 1)
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        top_k=None if top_k is None else torch.full((rows,), top_k),
        top_p=None if top_p is None else torch.full((rows,), top_p),
        generators=generators or {}, all_greedy=temperature == 0, all_random=temperature > 0)
    return DefaultSampler(VllmConfig.load())(logits, metadata).sampled_token_ids


def test_temperature_frequencies_pass_chi_square():
    torch.manual_seed(0)
    for temperature in (0.6, 1.0, 1.7):
        counts = torch.bincount(sample(temperature), minlength=len(LOGITS)).double()
        expected = torch.softmax(LOGITS.double() / temperature, dim=0) * ROWS
        keep = expected > 5  # chi-square needs expected counts of at least ~5
        if not keep.all():  # pool the rare tail into one bin
            counts = torch.cat([counts[keep], counts[~keep].sum().unsqueeze(0)])
            expected = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
        observed = counts
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3, temperature


def test_greedy_is_argmax():
    assert set(sample(0.0, rows=50).tolist()) == {0}


@pytest.mark.parametrize("k", [1, 2, 5])
def test_top_k_only_the_k_best_appear(k):
    seen = set(sample(1.5, top_k=k).tolist())
    assert seen == set(range(k))  # all of them, and nothing else


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_only_the_nucleus_appears(p):
    probs = torch.softmax(LOGITS, dim=0)
    cumulative = torch.cumsum(probs, dim=0)
    nucleus = int((cumulative < p).sum()) + 1  # the smallest prefix whose mass reaches p
    seen = set(sample(1.0, top_p=p).tolist())
    assert seen == set(range(nucleus))
    if nucleus > 1:  # inside the nucleus, the renormalised distribution
        counts = torch.bincount(sample(1.0, top_p=p), minlength=len(LOGITS)).double()[:nucleus]
        expected = probs[:nucleus].double() / probs[:nucleus].double().sum() * counts.sum()
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("min_p, temperature", [(0.2, 1.0), (0.5, 0.5), (0.05, 2.0)])
def test_min_p_drops_unlikely_tokens_at_the_request_temperature(min_p, temperature):
    params = SamplingParams(temperature=temperature, min_p=min_p)
    logits = LOGITS.repeat(ROWS, 1)
    view = LogitsRequestView(params, [1], [], None)
    MinPLogitsProcessor(VllmConfig.load()).apply(logits, torch.arange(ROWS), [view] * ROWS)
    metadata = SamplingMetadata(torch.full((ROWS,), temperature), None, None, {}, False, True)
    seen = set(DefaultSampler(VllmConfig.load())(logits, metadata).sampled_token_ids.tolist())
    probs = torch.softmax(LOGITS / temperature, dim=0)
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= min_p * probs.max().item() - 1e-9}
    assert seen == allowed


def test_seeded_rows_ignore_the_rest_of_the_batch():
    def with_seed(rows, row):
        generator = torch.Generator().manual_seed(42)
        return sample(1.0, rows=rows, generators={row: generator})[row].item()

    draws = {with_seed(1, 0), with_seed(16, 5), with_seed(64, 63)}
    assert len(draws) == 1
    assert math.isfinite(draws.pop())
