"""A sampler samples the tempered distribution (chi-square), keeps greedy rows greedy, honours top-k and
top-p, and gives a seeded row the same token whatever else shares its batch."""

from __future__ import annotations

import pytest
import torch

from engine.config import VllmConfig
from engine.interfaces.sampler import SamplingMetadata
from engine.testing.conformance.conftest import implementation

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
ROWS = 20000


def metadata(rows: int, temperature, top_k=None, top_p=None, seeds: dict | None = None, output_index: int = 0):
    temps = torch.as_tensor(temperature, dtype=torch.float32).expand(rows).clone()
    greedy = temps < 1e-5
    seeded = torch.zeros(rows, dtype=torch.bool)
    seed_column = torch.zeros(rows, dtype=torch.int64)
    for row, seed in (seeds or {}).items():
        seeded[row], seed_column[row] = True, seed
    return SamplingMetadata(
        temps,
        None if top_k is None else torch.full((rows,), top_k),
        None if top_p is None else torch.full((rows,), top_p),
        bool(greedy.all()),
        not bool(greedy.any()),
        [f"r{i}" for i in range(rows)],
        seed_column if seeds else None,
        seeded if seeds else None,
        torch.full((rows,), output_index) if seeds else None,
    )


@pytest.fixture
def sampler(sampler_name):
    return implementation("sampler", sampler_name).create(VllmConfig.load())


def sample(sampler, rows: int, **kwargs) -> torch.Tensor:
    out = sampler(LOGITS.repeat(rows, 1), metadata(rows, **kwargs)).sampled_token_ids
    assert out.shape == (rows,) and out.dtype == torch.int64
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_samples_the_tempered_distribution(sampler, temperature):
    from scipy.stats import chisquare

    torch.manual_seed(0)
    counts = torch.bincount(sample(sampler, ROWS, temperature=temperature), minlength=len(LOGITS)).double()
    expected = torch.softmax(LOGITS.double() / temperature, dim=0) * ROWS
    keep = expected > 5  # chi-square wants expected counts of at least ~5: pool the rare tail
    observed, expected = counts[keep], expected[keep]
    if not keep.all():
        observed = torch.cat([observed, counts[~keep].sum().unsqueeze(0)])
        expected = torch.cat(
            [expected, (torch.softmax(LOGITS.double() / temperature, dim=0) * ROWS)[~keep].sum().unsqueeze(0)]
        )
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4


def test_greedy_rows_take_the_argmax_in_a_mixed_batch(sampler):
    temperature = torch.tensor([0.0, 1.0] * 50)
    out = sampler(LOGITS.repeat(100, 1), metadata(100, temperature)).sampled_token_ids
    assert set(out[0::2].tolist()) == {0}
    assert len(set(out[1::2].tolist())) > 1


def test_top_k_and_top_p(sampler):
    assert set(sample(sampler, 2000, temperature=1.5, top_k=2).tolist()) == {0, 1}
    assert set(sample(sampler, 2000, temperature=1.0, top_p=0.3).tolist()) == {0}


def test_a_seeded_row_ignores_its_batch(sampler):
    def draw(rows, row, seed=42, output_index=3):
        return sample(sampler, rows, temperature=1.0, seeds={row: seed}, output_index=output_index)[row].item()

    assert len({draw(1, 0), draw(16, 5), draw(64, 63), draw(1, 0)}) == 1
    assert len({draw(1, 0, seed=s) for s in range(40)}) > 3  # seeds matter
    assert len({draw(1, 0, output_index=i) for i in range(40)}) > 3  # and each step draws anew
