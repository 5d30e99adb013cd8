"""Beam search as vLLM runs it: each step, every live beam is a one-token request asking for the top
``2 * beam_width`` log-probabilities; the best ``beam_width`` extensions survive. Beams share their KV blocks
through the prefix cache (a beam's request is its parent's tokens plus one), so no block is copied per beam.

A beam that samples EOS among the best ``beam_width`` candidates of a step is finished (unless ``ignore_eos``), as
transformers' beam search does. At the end the finished and the live beams are ranked
by ``cum_logprob / length ** length_penalty`` (the length counts the prompt, without a final EOS, as vLLM), and the
best ``beam_width`` are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from engine.errors import InvalidParameterError
from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams, ``max_tokens`` new tokens at most; InvalidParameterError naming a bad field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name, value in (("beam_width", self.beam_width), ("max_tokens", self.max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"BeamSearchParams.{name} must be a positive integer, got {value!r}", name)
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            raise InvalidParameterError(
                f"BeamSearchParams.length_penalty must be a number, got {self.length_penalty!r}", "length_penalty"
            )

    def step_params(self) -> SamplingParams:
        """The settings of one beam's one-token step: its top ``2 * beam_width`` log-probabilities."""
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's then the generated ones (as vLLM), ``text`` the generated text."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None  # "stop": it sampled EOS; "length": max_tokens reached

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: Optional[int], length_penalty: float) -> float:
    """vLLM's ranking: cumulative log-probability over ``length ** length_penalty`` (a final EOS not counted)."""
    length = len(beam.tokens) - (1 if eos_token_id is not None and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (length**length_penalty)


class BeamSearchInstance:
    """The beams of one prompt across the steps."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: Optional[int]):
        self.params = params
        self.eos_token_id = eos_token_id
        self.beams = [BeamSearchSequence(list(prompt_token_ids), len(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.beams

    def advance(self, step_logprobs: list[Optional[PositionLogprobs]]) -> None:
        """Extend each live beam by the candidates of its step (``step_logprobs[i]``: beam i's top log-probabilities;
        None: the beam could not go on, e.g. at the context length) and keep the best ``beam_width``."""
        candidates = []
        for beam, position in zip(self.beams, step_logprobs):
            if position is None:
                self.completed.append(replace(beam, finish_reason="length"))
                continue
            for token_id, logprob in position.items():
                candidates.append(
                    BeamSearchSequence(
                        beam.tokens + [token_id],
                        beam.num_prompt_tokens,
                        beam.cum_logprob + logprob.logprob,
                        beam.logprobs + [position],
                    )
                )
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length per step: the same order as the score
        self.beams = []
        for rank, beam in enumerate(candidates[: 2 * self.params.beam_width]):
            if len(self.beams) == self.params.beam_width:
                break
            if beam.tokens[-1] == self.eos_token_id and not self.params.ignore_eos:
                if rank < self.params.beam_width:  # an ending among the best beam_width finishes a beam
                    beam.finish_reason = "stop"
                    self.completed.append(beam)
            else:
                self.beams.append(beam)
        if self.beams and len(self.beams[0].output_token_ids) >= self.params.max_tokens:
            for beam in self.beams:
                beam.finish_reason = "length"
            self.completed += self.beams
            self.beams = []

    def result(self, tokenizer: Any) -> BeamSearchOutput:
        """The best ``beam_width`` beams (finished and live alike), best first, with their text."""
        ranked = sorted(
            self.completed + self.beams,
            key=lambda b: beam_score(b, self.eos_token_id, self.params.length_penalty),
            reverse=True,
        )[: self.params.beam_width]
        for beam in ranked:
            output = beam.output_token_ids
            if beam.finish_reason == "stop" and output and output[-1] == self.eos_token_id:
                output = output[:-1]
            beam.finish_reason = beam.finish_reason or "length"
            beam.text = tokenizer.decode(output, skip_special_tokens=True) if tokenizer is not None else ""
        return BeamSearchOutput(ranked)
