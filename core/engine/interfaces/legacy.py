"""Contract 1.0-1.2 views for logits processors and samplers, and the adapters that keep such plugins working.

Before contract 1.3 a logits processor got one ``LogitsRequestView`` (Python lists) per row and a sampler
got ``generators`` (one seeded ``torch.Generator`` per seeded row). A plugin that declares an older 1.x
contract is wrapped in an adapter that builds those views from the 1.3 tensors; it works as before, at
the old per-step cost, and the engine warns once, naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from engine.interfaces.logits_processor import LogitsBatch, LogitsRequestView
from engine.interfaces.sampler import SamplingMetadata

logger = logging.getLogger(__name__)

TENSOR_VIEW_CONTRACT = (1, 3)  # the first contract whose processors and samplers take tensor views


@dataclass
class LegacySamplingMetadata(SamplingMetadata):
    """Contract 1.2 sampler view: the 1.3 fields plus one seeded generator per seeded row."""

    generators: dict[int, torch.Generator] = dataclasses.field(default_factory=dict)


def step_generator(seed: int, output_index: int) -> torch.Generator:
    """Contract 1.2's generator for one sampling step of a seeded request (independent of batch and preemption)."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def request_views(batch: LogitsBatch) -> list[LogitsRequestView]:
    token_ids = batch.token_ids.tolist()
    num_prompt, num_tokens, eos = (
        batch.num_prompt_tokens.tolist(),
        batch.num_tokens.tolist(),
        batch.eos_token_ids.tolist(),
    )
    return [
        LogitsRequestView(params, tokens[:p], tokens[p:n], None if e < 0 else e)
        for params, tokens, p, n, e in zip(batch.params, token_ids, num_prompt, num_tokens, eos)
    ]


def legacy_metadata(metadata: SamplingMetadata) -> LegacySamplingMetadata:
    generators = {}
    if metadata.seeded is not None:
        assert metadata.seeds is not None and metadata.output_index is not None
        for row in metadata.seeded.nonzero().squeeze(1).tolist():
            generators[row] = step_generator(int(metadata.seeds[row]), int(metadata.output_index[row]))
    return LegacySamplingMetadata(
        **{f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}, generators=generators
    )


class LegacyLogitsProcessorAdapter:
    """Runs a contract-1.2 logits processor on the 1.3 batch view."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.requested_by = processor.requested_by

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> None:
        self.processor.apply(logits, batch.rows, request_views(batch))


class LegacySamplerAdapter:
    """Runs a contract-1.2 sampler on the 1.3 metadata (adding the seeded generators it expects)."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> Any:
        return self.sampler(logits, legacy_metadata(metadata))


def contract_tuple(version: str) -> tuple[int, int]:
    major, _, minor = str(version).partition(".")
    return int(major), int(minor or 0)


def adapt_for_contract(kind: str, instance: Any, name: str, source: str, contract: str) -> Any:
    """``instance`` itself, or wrapped in its kind's adapter when its plugin declares a pre-1.3 contract."""
    adapters: dict[str, type] = {"sampler": LegacySamplerAdapter, "logits_processor": LegacyLogitsProcessorAdapter}
    if kind not in adapters or contract_tuple(contract) >= TENSOR_VIEW_CONTRACT:
        return instance
    message = (
        f"{kind} '{name}' from {source} is written for plugin contract {contract}: it runs through an "
        f"adapter that rebuilds the per-request Python views every step (deprecated; contract 1.3 "
        f"hands {kind}s tensor views, see docs/plugins.md)"
    )
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    logger.warning(message)
    return adapters[kind](instance)
