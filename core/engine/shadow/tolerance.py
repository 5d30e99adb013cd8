"""The tolerance table of each dtype: how far a correct implementation's log-probabilities may stray from another
correct one's on the same weights (docs/operations.md justifies the figures)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DtypeTolerance:
    """``margin``: a top-1 / top-2 log-probability gap (nats) at or below which two correct implementations may
    order the two tokens either way (a near-tie); ``logprob``: the mean absolute difference (nats) of a token's
    log-probability that two correct implementations stay under."""

    dtype: str
    unit_roundoff: float
    margin: float
    logprob: float

    def as_dict(self) -> dict:
        return asdict(self)


TOLERANCES: dict[str, DtypeTolerance] = {
    "float32": DtypeTolerance("float32", 2.0**-24, margin=1e-3, logprob=1e-3),
    "float16": DtypeTolerance("float16", 2.0**-11, margin=0.05, logprob=0.03),
    "bfloat16": DtypeTolerance("bfloat16", 2.0**-8, margin=0.25, logprob=0.15),
}


def tolerance_for(*dtypes: str) -> DtypeTolerance:
    """The loosest tolerance of the dtypes compared (float32 against bfloat16 is held to bfloat16's)."""
    known = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        if name not in TOLERANCES:
            raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}")
        known.append(TOLERANCES[name])
    return max(known, key=lambda t: t.unit_roundoff)
