"""The comparison of a shadow with its primary: token by token on the primary's own tokens (top-1 agreement that
knows near-ties, the primary token's log-probability under each) and request by request in speed (time per output
token), each with a confidence interval, and the verdicts drawn from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from engine.outputs import PositionLogprobs
from engine.shadow.tolerance import DtypeTolerance

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
LOGPROB_DELTA_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)


def t_quantile(degrees_of_freedom: int) -> float:
    return _T975[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T975) else 1.96


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """95% interval of a proportion (Wilson's score interval: sound at 0 and 1 and for few trials)."""
    if trials == 0:
        return 0.0, 1.0
    z = 1.96
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


class RunningMean:
    """Mean and variance in one pass (Welford), with the 95% t-interval of the mean."""

    def __init__(self) -> None:
        self.count, self.mean, self._m2 = 0, 0.0, 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self._m2 += delta * (value - self.mean)

    def interval(self) -> Optional[tuple[float, float]]:
        if self.count < 2:
            return None
        half = t_quantile(self.count - 1) * math.sqrt(self._m2 / (self.count - 1) / self.count)
        return self.mean - half, self.mean + half


@dataclass
class Divergence:
    """The first position where the shadow's top token differs from the primary's beyond a near-tie."""

    request_id: str
    position: int  # index among the request's output tokens
    primary_token: int
    shadow_token: int
    primary_margin: Optional[float]  # the primary's top-1 minus top-2 log-probability, nats

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _top(position: PositionLogprobs, rank: int) -> Optional[tuple[int, float]]:
    for token, entry in position.items():
        if entry.rank == rank:
            return token, entry.logprob
    return None


@dataclass
class ShadowComparison:
    """Everything compared so far between one shadow and the primary; ``report()`` gives the verdicts."""

    tolerance: DtypeTolerance
    tokens_compared: int = 0
    top1_agreements: int = 0
    near_tie_disagreements: int = 0
    counted_disagreements: int = 0
    first_divergence: Optional[Divergence] = None
    logprob_delta: RunningMean = field(default_factory=RunningMean)  # shadow minus primary, the primary's token
    abs_logprob_delta: RunningMean = field(default_factory=RunningMean)
    delta_histogram: list[int] = field(default_factory=lambda: [0] * (len(LOGPROB_DELTA_BUCKETS) + 1))
    log_tpot_ratio: RunningMean = field(default_factory=RunningMean)  # log(shadow TPOT / primary TPOT), clean pairs
    contended_pairs: int = 0  # latency pairs left out: the primary and the shadow ran at the same time
    requests_compared: int = 0
    errors: int = 0
    first_error: Optional[str] = None

    def add_tokens(
        self,
        request_id: str,
        tokens: list[int],
        primary: list[PositionLogprobs],
        shadow: list[Optional[PositionLogprobs]],
    ) -> None:
        """Compare one request: ``primary[j]`` is the primary's distribution (with its top 2) where it produced
        ``tokens[j]``; ``shadow[j]`` the shadow's at the same position, teacher-forced on ``tokens[:j]``."""
        self.requests_compared += 1
        for position, (token, mine, theirs) in enumerate(zip(tokens, primary, shadow)):
            if theirs is None or token not in mine or token not in theirs:
                continue
            primary_top, primary_second = _top(mine, 1), _top(mine, 2)
            shadow_top = _top(theirs, 1)
            if primary_top is None or shadow_top is None:
                continue
            self.tokens_compared += 1
            delta = theirs[token].logprob - mine[token].logprob
            self.logprob_delta.add(delta)
            self.abs_logprob_delta.add(abs(delta))
            self.delta_histogram[_bucket(abs(delta))] += 1
            if shadow_top[0] == primary_top[0]:
                self.top1_agreements += 1
                continue
            margin = primary_top[1] - primary_second[1] if primary_second is not None else None
            if margin is not None and margin <= self.tolerance.margin:
                self.near_tie_disagreements += 1
                continue
            self.counted_disagreements += 1
            if self.first_divergence is None:
                self.first_divergence = Divergence(request_id, position, primary_top[0], shadow_top[0], margin)

    def add_latency(self, primary_tpot: float, shadow_tpot: float, contended: bool) -> None:
        """One request's time per output token on each; a pair that ran while the other engine worked is counted
        but left out of the ratio (either side's time would be the other's load)."""
        if contended:
            self.contended_pairs += 1
        elif primary_tpot > 0 and shadow_tpot > 0:
            self.log_tpot_ratio.add(math.log(shadow_tpot / primary_tpot))

    def add_error(self, message: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = message

    def numerics_verdict(self) -> str:
        """fails (the shadow raised), diverges (a top-1 flip beyond a near-tie, or a mean log-probability shift
        whose whole 95% interval lies beyond the dtype's tolerance), equivalent, or no data yet."""
        if self.errors:
            return "fails"
        if self.counted_disagreements:
            return "diverges"
        interval = self.abs_logprob_delta.interval()
        if interval is not None and interval[0] > self.tolerance.logprob:
            return "diverges"
        return "equivalent" if self.tokens_compared else "no data"

    def speed_verdict(self) -> str:
        interval = self.log_tpot_ratio.interval()
        if interval is None:
            return "no data"
        if interval[1] < 0:
            return "faster"
        if interval[0] > 0:
            return "slower"
        return "same speed"

    def report(self) -> dict:
        agreement_ci = wilson_interval(self.top1_agreements, self.tokens_compared)
        delta_ci = self.logprob_delta.interval()
        abs_ci = self.abs_logprob_delta.interval()
        ratio_ci = self.log_tpot_ratio.interval()
        return {
            "verdict": self.numerics_verdict(),
            "speed_verdict": self.speed_verdict(),
            "tolerance": self.tolerance.as_dict(),
            "requests_compared": self.requests_compared,
            "tokens_compared": self.tokens_compared,
            "top1_agreement": {
                "rate": self.top1_agreements / self.tokens_compared if self.tokens_compared else None,
                "ci95": list(agreement_ci) if self.tokens_compared else None,
                "near_tie_disagreements": self.near_tie_disagreements,
                "counted_disagreements": self.counted_disagreements,
            },
            "logprob_delta": {
                "mean": self.logprob_delta.mean if self.tokens_compared else None,
                "ci95": list(delta_ci) if delta_ci else None,
                "mean_abs": self.abs_logprob_delta.mean if self.tokens_compared else None,
                "mean_abs_ci95": list(abs_ci) if abs_ci else None,
                "histogram": {"le": [*LOGPROB_DELTA_BUCKETS, "+Inf"], "counts": list(self.delta_histogram)},
            },
            "first_divergence": self.first_divergence.as_dict() if self.first_divergence else None,
            "tpot_ratio": {
                "geometric_mean": math.exp(self.log_tpot_ratio.mean) if self.log_tpot_ratio.count else None,
                "ci95": [math.exp(ratio_ci[0]), math.exp(ratio_ci[1])] if ratio_ci else None,
                "pairs": self.log_tpot_ratio.count,
                "contended_pairs": self.contended_pairs,
            },
            "errors": {"count": self.errors, "first": self.first_error},
        }


def _bucket(value: float) -> int:
    for index, bound in enumerate(LOGPROB_DELTA_BUCKETS):
        if value <= bound:
            return index
    return len(LOGPROB_DELTA_BUCKETS)
