"""SamplingParams: what a request asks of generation, with vLLM's field names and validation."""
from __future__ import annotations

from typing import Any, Optional

import msgspec

_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Generation settings of one request. Invalid values raise ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    skip_prefix_cache: bool = False
    extra_args: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be non-negative"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (off), 0 (off) or positive"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative token ids"),
        ]
        for field, ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field} {message}, got {getattr(self, field)!r}")
        if self.n != 1:
            raise ValueError(f"SamplingParams.n > 1 is not supported yet, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)
