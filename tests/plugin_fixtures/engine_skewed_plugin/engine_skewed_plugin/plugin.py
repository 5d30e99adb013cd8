"""Plugins that are wrong in ways no smoke test sees: each one runs, and answers almost right.

- ``skewed_scale`` attention: the torch backend with its softmax scale 1% too large;
- ``bf16_round`` layer kernels: native products whose results are rounded to bfloat16 (an accumulator kept in
  bfloat16), whatever the model's dtype;
- ``flaky`` attention: the torch backend, raising on any step of exactly a multiple of 50 tokens (one request in
  about 50, always the same ones);
- ``mass_shift`` sampler: the default sampler after moving 1% of each row's probability from its most likely token
  to its second.
"""

import torch

from engine import hookimpl
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl
from engine.interfaces.sampler import SamplerOutput
from engine.model.layers.native_kernels import NativeLayerKernels
from engine.sample.default_sampler import DefaultSampler
from engine.sample.ops import random_sample, sampling_weights

ENGINE_CONTRACT_VERSION = "1.14"


class SkewedScaleImpl(TorchAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale *= 1.01


class SkewedScaleBackend(TorchAttentionBackend):
    name = "skewed_scale"
    priority = -1

    @staticmethod
    def get_impl_cls():
        return SkewedScaleImpl


class FlakyImpl(TorchAttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata):
        if attn_metadata.num_actual_tokens % 50 == 0:
            raise RuntimeError(f"flaky attention: a step of {attn_metadata.num_actual_tokens} tokens")
        return super().forward(query, key, value, kv_cache, attn_metadata)


class FlakyBackend(TorchAttentionBackend):
    name = "flaky"
    priority = -1

    @staticmethod
    def get_impl_cls():
        return FlakyImpl


class Bf16RoundedKernels(NativeLayerKernels):
    name = "bf16_round"
    priority = -1

    def pack_linear(self, weight, bias=None):
        inner = super().pack_linear(weight, bias)

        def rounded(x):
            out = inner(x) if inner is not None else torch.nn.functional.linear(x, weight.to(x.dtype), bias)
            return out.to(torch.bfloat16).to(x.dtype)

        return rounded


class MassShiftSampler(DefaultSampler):
    name = "mass_shift"
    priority = -1

    def __call__(self, logits, metadata):
        if metadata.all_greedy:
            return super().__call__(logits, metadata)
        weights = sampling_weights(logits, metadata).double()
        probs = weights / weights.sum(dim=-1, keepdim=True)
        top = probs.topk(2, dim=-1).indices
        shift = probs.gather(1, top[:, :1]).clamp(max=0.01)
        probs.scatter_add_(1, top[:, :1], -shift)
        probs.scatter_add_(1, top[:, 1:], shift)
        return SamplerOutput(random_sample(probs, metadata.uniform()))


@hookimpl
def engine_samplers():
    return [MassShiftSampler]


@hookimpl
def engine_attention_backends():
    return [SkewedScaleBackend, FlakyBackend]


@hookimpl
def engine_layer_kernels():
    return [Bf16RoundedKernels]
