"""The default sampler and the built-in logits processors on fixed distributions (statistical tests)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from engine.config import VllmConfig
from engine.interfaces.logits_processor import LogitsBatch
from engine.interfaces.sampler import SamplingMetadata
from engine.sample.builtin_logits_processors import MinPLogitsProcessor
from engine.sample.default_sampler import DefaultSampler
from engine.sample.ops import apply_top_k_top_p, greedy_tokens
from engine.sampling_params import SamplingParams

ROWS = 20000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def sample(temperature=1.0, top_k=None, top_p=None, rows=ROWS, seeds=None, output_index=0):
    """``seeds``: {row: seed} for the seeded rows."""
    logits = LOGITS.repeat(rows, 1)
    seeded = torch.zeros(rows, dtype=torch.bool)
    seed_column = torch.zeros(rows, dtype=torch.int64)
    for row, seed in (seeds or {}).items():
        seeded[row], seed_column[row] = True, seed
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        top_k=None if top_k is None else torch.full((rows,), top_k),
        top_p=None if top_p is None else torch.full((rows,), top_p),
        all_greedy=temperature == 0,
        all_random=temperature > 0,
        seeds=seed_column if seeds else None,
        seeded=seeded if seeds else None,
        output_index=torch.full((rows,), output_index) if seeds else None,
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax_with_ties_nans_and_strides(dtype):
    """The NumPy path for float32 rows gives torch.argmax's index: the first of tied maxima, the first NaN, 0 for a
    row of -inf, on strided views too; 16-bit rows take torch's."""
    torch.manual_seed(0)
    logits = torch.randn(7, 49152).to(dtype)
    logits[1, [5, 900, 40000]] = 50.0  # a tie: the first wins
    logits[2, [7000, 30]] = float("nan")  # NaN counts as the largest: the first NaN
    logits[3] = float("-inf")
    logits[4, -1] = float("inf")
    for view in (logits, logits[::2], logits[:, 1000:], logits.t().contiguous().t()):
        tokens = greedy_tokens(view)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, view.argmax(dim=-1))
    assert greedy_tokens(logits)[1:5].tolist() == [5, 30, 0, 49151]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_top_k_only_the_k_best_appear(k):
    seen = set(sample(1.5, top_k=k).tolist())
    assert seen == set(range(k))  # all of them, and nothing else


def sorted_top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k by sorting each whole row: the k-th largest value is the threshold, ties with it kept."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = logits.sort(dim=-1).values.gather(1, (vocab - k).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


@pytest.mark.parametrize("ks", [[1, 3, 0, 40], [2, 2, 2, 2], [0, 0, 7, 0], [300, 5, 1000, 0], [0, 0, 0, 0]])
def test_top_k_without_a_sort_masks_the_tokens_a_sort_masks(ks):
    """The top-k-only path (one topk of the batch's largest k) keeps exactly the tokens the sorted threshold keeps:
    ties at the k-th value, rows with k off (0) or past the vocabulary, k near the vocabulary's size."""
    generator = torch.Generator().manual_seed(len(ks) + sum(ks))
    rows = len(ks)
    logits = torch.randn(rows, 512, generator=generator)
    logits[:, ::7] = logits[:, :1]  # many ties, some at the k-th value
    logits[1, :] = torch.round(logits[1, :])  # a row of a few distinct values
    top_k = torch.tensor(ks)
    fast = apply_top_k_top_p(logits.clone(), top_k, None)
    assert torch.equal(fast, sorted_top_k_mask(logits, top_k))
    kept = (fast > float("-inf")).sum(dim=-1)
    for row, k in enumerate(ks):
        assert kept[row] >= min(k if k > 0 else 512, 512)  # at least k, more only by ties


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
    batch = LogitsBatch.from_requests([params] * ROWS, [[1]] * ROWS, [[]] * ROWS)
    MinPLogitsProcessor(VllmConfig.load()).apply(logits, batch)
    metadata = SamplingMetadata(torch.full((ROWS,), temperature), None, None, False, True)
    seen = set(DefaultSampler(VllmConfig.load())(logits, metadata).sampled_token_ids.tolist())
    probs = torch.softmax(LOGITS / temperature, dim=0)
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= min_p * probs.max().item() - 1e-9}
    assert seen == allowed


def test_seeded_rows_ignore_the_rest_of_the_batch():
    def with_seed(rows, row, seed=42, output_index=3):
        return sample(1.0, rows=rows, seeds={row: seed}, output_index=output_index)[row].item()

    draws = {with_seed(1, 0), with_seed(16, 5), with_seed(64, 63)}
    assert len(draws) == 1
    assert math.isfinite(draws.pop())
    # and the draws do vary with the seed and with the step: the rows are not all given one number
    assert len({with_seed(1, 0, seed=s) for s in range(40)}) > 3
    assert len({with_seed(1, 0, output_index=i) for i in range(40)}) > 3


def test_seeded_draws_follow_the_distribution():
    """Seeded rows (one seed per row) sample the tempered distribution as unseeded ones do."""
    counts = torch.bincount(sample(1.0, seeds={row: row * 7919 for row in range(ROWS)}), minlength=len(LOGITS))
    expected = torch.softmax(LOGITS.double(), dim=0) * ROWS
    assert (expected > 5).all()
    assert chisquare(counts.double().numpy(), expected.numpy()).pvalue > 1e-3


def _sequential_inverse_cdf(weights, uniform):
    """The one-level reference: a float64 running sum over the whole vocabulary, token by token."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    target = uniform.reshape(-1, 1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)


@pytest.mark.parametrize("vocab", [49152, 1024, 151936])
def test_the_two_level_inverse_cdf_draws_what_the_sequential_scan_draws(vocab):
    """Large vocabularies are sampled in two levels (blocks' sums, then one block token by token): the same token
    as the sequential float64 scan for every draw here, never a token of weight zero (every other token and whole
    blocks zero, draws at 0 and just below 1), and a row alone draws what it draws in its batch."""
    from engine.sample.ops import random_sample, scan_block_size

    assert scan_block_size(vocab) is not None
    gen = torch.Generator().manual_seed(vocab)
    rows = 96
    weights = torch.rand(rows, vocab, generator=gen) ** 6
    weights[:, 1::2] = 0.0
    weights[: rows // 2, : vocab // 2] = 0.0  # half the rows: the first half of the vocabulary (whole blocks) empty
    uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
    uniform[:4] = torch.tensor([0.0, 1.0 - 2**-53, 0.5, 2**-40], dtype=torch.float64)
    drawn = random_sample(weights, uniform)
    assert torch.equal(drawn, _sequential_inverse_cdf(weights, uniform))
    assert bool((weights.gather(1, drawn.unsqueeze(1)) > 0).all())
    for row in (0, 1, 50, rows - 1):
        assert torch.equal(random_sample(weights[row : row + 1], uniform[row : row + 1]), drawn[row : row + 1])


def test_a_large_vocabulary_is_sampled_at_its_tempered_frequencies():
    """The default sampler on a 1,024-token vocabulary (the two-level scan), mass spread over every block."""
    torch.manual_seed(1)
    vocab, rows, temperature = 1024, 20000, 0.8
    logits = torch.linspace(1.5, -1.5, 16).repeat_interleave(vocab // 16)  # 16 levels, 64 tokens each
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), temperature), top_k=None, top_p=None, all_greedy=False, all_random=True
    )
    drawn = DefaultSampler(VllmConfig.load())(logits.repeat(rows, 1), metadata).sampled_token_ids
    counts = torch.bincount(drawn // (vocab // 16), minlength=16).double()  # per level
    expected = torch.softmax(logits.double() / temperature, dim=0).view(16, -1).sum(-1) * rows
    assert (expected > 5).all()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_penalties_touch_only_seen_tokens_and_equal_the_dense_formula():
    """The sparse penalties (only the tokens a row has seen) give bit for bit what the formula gives on the
    whole [rows, vocab] matrix, for mixed rows, and leave the rows that did not ask untouched."""
    from engine.sample.builtin_logits_processors import PenaltiesLogitsProcessor

    gen = torch.Generator().manual_seed(5)
    vocab, n = 300, 12
    params = [
        SamplingParams(
            presence_penalty=0.5 * (i % 3),
            frequency_penalty=0.3 * (i % 2) - 0.1,
            repetition_penalty=[1.0, 1.3, 0.8][i % 3] if i % 4 else 1.2,
        )
        for i in range(n)
    ]
    prompts = [
        torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    outputs = [
        torch.randint(0, 50, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    batch = LogitsBatch.from_requests(params, prompts, outputs)
    batch.rows = torch.randperm(n + 3, generator=gen)[:n]  # rows spread over a larger logits matrix
    logits = torch.randn(n + 3, vocab, generator=gen)
    expected = logits.clone()
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        row = int(batch.rows[i])
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).float()
        seen = (torch.bincount(torch.tensor(prompt), minlength=vocab) > 0) | (counts > 0)
        x = expected[row]
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        expected[row] = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    PenaltiesLogitsProcessor(VllmConfig.load()).apply(logits, batch)
    assert torch.equal(logits, expected)
