"""The default sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.hookspecs import hookimpl
from engine.interfaces.sampler import Sampler, SamplerOutput, SamplingMetadata
from engine.sample.ops import greedy_tokens, random_sample, sampling_weights
from engine.sampling_params import GREEDY_EPS


class DefaultSampler(Sampler):
    """Greedy rows take the argmax; the others sample from the tempered, truncated distribution."""

    name = "default"
    priority = 10

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.all_greedy:
            return SamplerOutput(greedy_tokens(logits))
        greedy = None if metadata.all_random else greedy_tokens(logits)  # before the logits are rescaled
        sampled = random_sample(sampling_weights(logits, metadata), metadata.uniform())
        if greedy is not None:  # some rows are greedy
            sampled = torch.where(metadata.temperature < GREEDY_EPS, greedy, sampled)
        return SamplerOutput(sampled)


@hookimpl
def engine_samplers():
    return [DefaultSampler]
