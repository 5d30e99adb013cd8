"""Built-in logits processors, registered through the LogitsProcessor hook.

Each acts, batched, on the rows of the requests whose SamplingParams ask for it. They run in
priority order (highest first) on the raw logits, before temperature, top-k and top-p.
"""
from __future__ import annotations

import math

import torch

from engine.hookspecs import hookimpl
from engine.interfaces.logits_processor import LogitsProcessor, LogitsRequestView


def _token_matrix(requests: list[LogitsRequestView], attribute: str, vocab: int, device) -> torch.Tensor:
    """[rows, vocab] counts of the tokens in ``request.<attribute>`` of each row."""
    sequences = [getattr(r, attribute) for r in requests]
    counts = torch.zeros(len(requests), vocab, device=device)
    lengths = torch.tensor([len(s) for s in sequences])
    if int(lengths.sum()):
        flat = torch.tensor([t for s in sequences for t in s], device=device)
        row_index = torch.repeat_interleave(torch.arange(len(requests), device=device), lengths.to(device))
        counts.index_put_((row_index, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)
    return counts


def _ban(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        rows, tokens = zip(*pairs)
        logits[torch.tensor(rows), torch.tensor(tokens)] = float("-inf")


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """Only ``allowed_token_ids`` may be sampled."""

    name = "allowed_token_ids"
    priority = 100

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.allowed_token_ids is not None

    def apply(self, logits, rows, requests):
        mask = torch.ones(len(requests), logits.shape[1], dtype=torch.bool, device=logits.device)
        for i, request in enumerate(requests):
            mask[i, request.params.allowed_token_ids] = False
        logits[rows] = logits[rows].masked_fill(mask, float("-inf"))


class BadWordsLogitsProcessor(LogitsProcessor):
    """A bad word's last token is banned whenever the output ends with the rest of it."""

    name = "bad_words"
    priority = 90

    @classmethod
    def requested_by(cls, params) -> bool:
        return bool(params.bad_words_token_ids)

    def apply(self, logits, rows, requests):
        pairs = []
        for row, request in zip(rows.tolist(), requests):
            output = request.output_token_ids
            for word in request.params.bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or output[len(output) - len(prefix):] == prefix:
                    pairs.append((row, word[-1]))
        _ban(logits, pairs)


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds ``logit_bias[token]`` to the token's logit."""

    name = "logit_bias"
    priority = 80

    @classmethod
    def requested_by(cls, params) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits, rows, requests):
        row_index, token_index, bias = [], [], []
        for row, request in zip(rows.tolist(), requests):
            for token, value in request.params.logit_bias.items():
                row_index.append(row)
                token_index.append(token)
                bias.append(value)
        logits.index_put_((torch.tensor(row_index), torch.tensor(token_index)),
                          torch.tensor(bias, dtype=logits.dtype), accumulate=True)


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbids EOS and the stop token ids until a request has ``min_tokens`` outputs."""

    name = "min_tokens"
    priority = 70

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.min_tokens > 0

    def apply(self, logits, rows, requests):
        pairs = []
        for row, request in zip(rows.tolist(), requests):
            if len(request.output_token_ids) >= request.params.min_tokens:
                continue
            stops = set(request.params.stop_token_ids)
            if request.eos_token_id is not None and not request.params.ignore_eos:
                stops.add(request.eos_token_id)
            pairs += [(row, token) for token in sorted(stops)]
        _ban(logits, pairs)


class PenaltiesLogitsProcessor(LogitsProcessor):
    """presence, frequency (generated tokens) and repetition (prompt and generated) penalties."""

    name = "penalties"
    priority = 60

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1

    def apply(self, logits, rows, requests):
        vocab, device = logits.shape[1], logits.device
        output_counts = _token_matrix(requests, "output_token_ids", vocab, device)
        seen = (_token_matrix(requests, "prompt_token_ids", vocab, device) > 0) | (output_counts > 0)
        column = lambda name: torch.tensor([getattr(r.params, name) for r in requests], dtype=logits.dtype,
                                           device=device).unsqueeze(1)
        repetition = column("repetition_penalty")
        sub = logits[rows]
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - column("frequency_penalty") * output_counts - column("presence_penalty") * (output_counts > 0)
        logits[rows] = sub


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens whose probability (at the request's temperature) is below min_p times the top one's.

    p_i / p_max = exp((l_i - l_max) / T), so the cut on raw logits is l_max + T * ln(min_p).
    """

    name = "min_p"
    priority = 10

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.min_p > 0 and not params.greedy

    def apply(self, logits, rows, requests):
        cut = torch.tensor([r.params.temperature * math.log(r.params.min_p) for r in requests],
                           dtype=logits.dtype, device=logits.device)
        sub = logits[rows]
        threshold = sub.max(dim=-1, keepdim=True).values + cut.unsqueeze(1)
        logits[rows] = sub.masked_fill(sub < threshold, float("-inf"))


@hookimpl
def engine_logits_processors():
    return [AllowedTokenIdsLogitsProcessor, BadWordsLogitsProcessor, LogitBiasLogitsProcessor,
            MinTokensLogitsProcessor, PenaltiesLogitsProcessor, MinPLogitsProcessor]
