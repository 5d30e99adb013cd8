"""Built-in logits processors, registered through the LogitsProcessor hook."""
from __future__ import annotations

import torch

from engine.hookspecs import hookimpl
from engine.interfaces.logits_processor import LogitsProcessor, LogitsRequestView


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbids EOS and the stop token ids until a request has ``min_tokens`` outputs."""

    name = "min_tokens"
    priority = 100

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.min_tokens > 0

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, requests: list[LogitsRequestView]) -> None:
        row_index, token_index = [], []
        for row, request in zip(rows.tolist(), requests):
            if len(request.output_token_ids) >= request.params.min_tokens:
                continue
            stops = set(request.params.stop_token_ids)
            if request.eos_token_id is not None and not request.params.ignore_eos:
                stops.add(request.eos_token_id)
            row_index += [row] * len(stops)
            token_index += sorted(stops)
        if row_index:
            logits[torch.tensor(row_index), torch.tensor(token_index)] = float("-inf")


@hookimpl
def engine_logits_processors():
    return [MinTokensLogitsProcessor]
