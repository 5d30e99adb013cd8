"""Built-in logits processors, registered through the LogitsProcessor hook.

Each acts, batched, on the rows of the requests whose SamplingParams ask for it. They run in
priority order (highest first) on the raw logits, before temperature, top-k and top-p.
"""

from __future__ import annotations

import torch

from engine.hookspecs import hookimpl
from engine.interfaces.logits_processor import LogitsBatch, LogitsProcessor


def _seen_tokens(batch: LogitsBatch, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token, times in the output) for every distinct token each row has seen in its prompt or output:
    sorted (row, token) keys, so the work is the batch's token count, never rows x vocabulary."""
    token_ids = batch.token_ids.to(device)
    position = torch.arange(token_ids.shape[1], device=device)
    num_prompt = batch.num_prompt_tokens.to(device).unsqueeze(1)
    keys = torch.arange(len(batch), device=device).unsqueeze(1) * vocab + token_ids
    prompt_keys = keys[position < num_prompt]
    output_keys = keys[(position >= num_prompt) & (position < batch.num_tokens.to(device).unsqueeze(1))]
    seen = torch.unique(torch.cat([prompt_keys, output_keys]))
    output_unique, output_counts = torch.unique(output_keys, return_counts=True)
    counts = torch.zeros(len(seen), dtype=torch.int64, device=device)
    counts[torch.searchsorted(seen, output_unique)] = output_counts
    return seen // vocab, seen % vocab, counts


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

    def apply(self, logits, batch):
        mask = torch.ones(len(batch), logits.shape[1], dtype=torch.bool, device=logits.device)
        for i, params in enumerate(batch.params):
            mask[i, params.allowed_token_ids] = False
        logits[batch.rows] = logits[batch.rows].masked_fill(mask, float("-inf"))


class BadWordsLogitsProcessor(LogitsProcessor):
    """A bad word's last token is banned whenever the output ends with the rest of it."""

    name = "bad_words"
    priority = 90

    @classmethod
    def requested_by(cls, params) -> bool:
        return bool(params.bad_words_token_ids)

    def apply(self, logits, batch):
        pairs = []
        for i, (row, params) in enumerate(zip(batch.rows.tolist(), batch.params)):
            longest = max(len(word) for word in params.bad_words_token_ids) - 1
            tail = batch.output_tail(i, longest)
            for word in params.bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or tail[len(tail) - len(prefix) :] == prefix:
                    pairs.append((row, word[-1]))
        _ban(logits, pairs)


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds ``logit_bias[token]`` to the token's logit."""

    name = "logit_bias"
    priority = 80

    @classmethod
    def requested_by(cls, params) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits, batch):
        row_index, token_index, bias = [], [], []
        for row, params in zip(batch.rows.tolist(), batch.params):
            for token, value in params.logit_bias.items():
                row_index.append(row)
                token_index.append(token)
                bias.append(value)
        logits.index_put_(
            (torch.tensor(row_index), torch.tensor(token_index)),
            torch.tensor(bias, dtype=logits.dtype),
            accumulate=True,
        )


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbids EOS and the stop token ids until a request has ``min_tokens`` outputs."""

    name = "min_tokens"
    priority = 70

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.min_tokens > 0

    def apply(self, logits, batch):
        pairs = []
        produced, eos = batch.num_output_tokens.tolist(), batch.eos_token_ids.tolist()
        for row, params, num_output, eos_token_id in zip(batch.rows.tolist(), batch.params, produced, eos):
            if num_output >= params.min_tokens:
                continue
            stops = set(params.stop_token_ids)
            if eos_token_id >= 0 and not params.ignore_eos:
                stops.add(eos_token_id)
            pairs += [(row, token) for token in sorted(stops)]
        _ban(logits, pairs)


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    """A reasoning model's ``thinking_token_budget``: once the reasoning has that many tokens and is still open,
    the tokens that close it (``reasoning_end_token_ids``) are forced, one per step."""

    name = "thinking_budget"
    priority = 65

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.thinking_token_budget is not None and bool(params.reasoning_end_token_ids)

    @staticmethod
    def forced_token(output: list[int], params) -> int | None:
        """The end token to force after ``output`` (None: the budget is not spent, or the reasoning is over)."""
        start, end = params.reasoning_start_token_ids, params.reasoning_end_token_ids
        begin = 0
        if start:
            if output[: len(start)] != start:
                return None  # no reasoning block opened this output
            begin = len(start)
        reasoning = output[begin:]
        if any(reasoning[i : i + len(end)] == end for i in range(len(reasoning) - len(end) + 1)):
            return None  # closed already
        done = next(j for j in range(len(end) - 1, -1, -1) if j == 0 or reasoning[-j:] == end[:j])
        if len(reasoning) - done < params.thinking_token_budget:
            return None
        return end[done]

    def apply(self, logits, batch):
        token_ids, num_prompt, num_tokens = batch.token_ids, batch.num_prompt_tokens.tolist(), batch.num_tokens.tolist()
        for i, (row, params) in enumerate(zip(batch.rows.tolist(), batch.params)):
            forced = self.forced_token(token_ids[i, num_prompt[i] : num_tokens[i]].tolist(), params)
            if forced is not None:
                logits[row] = float("-inf")
                logits[row, forced] = 0.0


class PenaltiesLogitsProcessor(LogitsProcessor):
    """presence, frequency (generated tokens) and repetition (prompt and generated) penalties.

    Only the (row, token) pairs a row has seen change, so only those are gathered, penalised and written
    back: the same float operations as on the whole [rows, vocab] matrix, at the cost of the seen tokens.
    """

    name = "penalties"
    priority = 60

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1

    def apply(self, logits, batch):
        row, token, counts = _seen_tokens(batch, logits.shape[1], logits.device)
        column = lambda name: batch.column(name).to(logits.device, logits.dtype)[row]
        rows = batch.rows.to(logits.device)[row]
        values = logits[rows, token]
        repetition = column("repetition_penalty")
        values = torch.where(values > 0, values / repetition, values * repetition)
        counts = counts.to(logits.dtype)
        values = values - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
        logits[rows, token] = values


class MinPLogitsProcessor(LogitsProcessor):
    """Drops tokens whose probability (at the request's temperature) is below min_p times the top one's.

    p_i / p_max = exp((l_i - l_max) / T), so the cut on raw logits is l_max + T * ln(min_p).
    """

    name = "min_p"
    priority = 10

    @classmethod
    def requested_by(cls, params) -> bool:
        return params.min_p > 0 and not params.greedy

    def apply(self, logits, batch):
        cut = (batch.column("temperature").double() * batch.column("min_p").double().log()).to(
            logits.device, logits.dtype
        )
        sub = logits[batch.rows]
        threshold = sub.max(dim=-1, keepdim=True).values + cut.unsqueeze(1)
        logits[batch.rows] = sub.masked_fill(sub < threshold, float("-inf"))


@hookimpl
def engine_logits_processors():
    return [
        AllowedTokenIdsLogitsProcessor,
        BadWordsLogitsProcessor,
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
        ThinkingBudgetLogitsProcessor,
        PenaltiesLogitsProcessor,
        MinPLogitsProcessor,
    ]
