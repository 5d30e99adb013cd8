"""The sampler's goodness of fit: many draws from known distributions through the sampler plugin, against the
probabilities themselves (a G-test over the categories, pooled where they expect fewer than 5 draws). A sampler
that moves 1% of the mass shows at p < 1e-12 with 400,000 draws; a correct one fails at p < 1e-6 once in a
million runs."""

from __future__ import annotations

import math
from typing import Any

import torch

P_VALUE_FLOOR = 1e-6
VOCAB = 1024
BATCH = 8192
CASES = (
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20},
)


def _logits(seed: int = 0) -> torch.Tensor:
    """A model-like distribution: a few likely tokens, then a long tail."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(VOCAB, dtype=torch.float32)
    logits = -1.2 * torch.log1p(ranks) + 0.3 * torch.randn(VOCAB, generator=generator)
    return logits[torch.randperm(VOCAB, generator=generator)]


def expected_probabilities(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """vLLM's sampling distribution: temperature, then top-k, then top-p (the smallest set whose mass reaches
    ``top_p``), renormalised; float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    sorted_probs = probs[order]
    count = len(probs) if top_k <= 0 else top_k
    if top_p < 1.0:
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens above each one
        count = min(count, int((before < top_p).sum()))
    keep[order[:count]] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def g_test(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float, int]:
    """(G statistic, p-value, degrees of freedom); categories expecting fewer than 5 draws are pooled. Tokens drawn
    that the distribution excludes give p = 0."""
    total = float(counts.sum())
    expected = expected_probs * total
    if float(counts[expected_probs == 0].sum()) > 0:
        return math.inf, 0.0, 0
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big & (expected_probs > 0)].double().sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big & (expected_probs > 0)].sum().reshape(1)])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    nonzero = observed > 0
    statistic = 2.0 * float((observed[nonzero] * torch.log(observed[nonzero] / wanted[nonzero])).sum())
    dof = int(keep.sum()) - 1
    # chi-square survival function: the regularised upper incomplete gamma Q(dof / 2, G / 2)
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )
    return statistic, p_value, dof


def check_sampler(config: Any, name: str, draws: int = 400_000, seed: int = 0) -> dict:
    """Draw ``draws`` tokens per case through the sampler plugin ``name`` and test each case's frequencies."""
    from engine.interfaces.sampler import SamplingMetadata
    from engine.plugins import get_plugin_manager

    impls = get_plugin_manager().implementations("sampler")
    if name not in impls:
        raise ValueError(f"no sampler named {name!r} is installed; installed: {sorted(impls)}")
    sampler = impls[name].create(config)
    logits = _logits(seed)
    torch.manual_seed(seed)
    cases = []
    for case in CASES:
        temperature, top_p = float(case["temperature"]), float(case.get("top_p", 1.0))
        top_k = int(case.get("top_k", 0))
        counts = torch.zeros(VOCAB, dtype=torch.float64)
        remaining = draws
        while remaining:
            rows = min(BATCH, remaining)
            metadata = SamplingMetadata(
                torch.full((rows,), temperature, dtype=torch.float32),
                torch.full((rows,), top_k, dtype=torch.int64) if top_k else None,
                torch.full((rows,), top_p, dtype=torch.float32) if top_p < 1.0 else None,
                False,
                True,
                [f"r{i}" for i in range(rows)],
            )
            tokens = sampler(logits.repeat(rows, 1), metadata).sampled_token_ids
            counts += torch.bincount(tokens, minlength=VOCAB).double()
            remaining -= rows
        expected = expected_probabilities(logits, temperature, top_p, top_k)
        statistic, p_value, dof = g_test(counts, expected)
        total_variation = 0.5 * float((counts / counts.sum() - expected).abs().sum())
        cases.append(
            {
                **case,
                "draws": draws,
                "g_statistic": statistic,
                "degrees_of_freedom": dof,
                "p_value": p_value,
                "total_variation": total_variation,
                "passes": p_value >= P_VALUE_FLOOR,
            }
        )
    worst = min(cases, key=lambda c: c["p_value"])
    return {
        "sampler": name,
        "p_value_floor": P_VALUE_FLOOR,
        "cases": cases,
        "worst": worst,
        "passes": all(c["passes"] for c in cases),
    }
