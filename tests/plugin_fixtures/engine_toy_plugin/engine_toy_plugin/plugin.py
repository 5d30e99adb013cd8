"""A third-party plugin exercising every hook; counters show that the engine really used each part.

It declares contract 1.1 on purpose: its logits processor and sampler use the pre-1.3 views
(``LogitsRequestView`` lists, seeded ``generators``) and must keep working through the adapters.
"""

from collections import Counter

import torch

from engine import hookimpl
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl
from engine.interfaces.executor import Executor
from engine.interfaces.logits_processor import LogitsProcessor
from engine.kv_cache.coordinators import UnitaryKVCacheCoordinator
from engine.model.llama import LlamaForCausalLM
from engine.sample.default_sampler import DefaultSampler
from engine.worker.worker import Worker

ENGINE_CONTRACT_VERSION = "1.1"
CALLS = Counter()


class ToyAttentionImpl(TorchAttentionImpl):
    def forward(self, *args, **kwargs):
        CALLS["attention"] += 1
        CALLS["attention_option"] = self.options.get("marker", 0)
        return super().forward(*args, **kwargs)


class ToyAttentionBackend(TorchAttentionBackend):
    name = "toy_attention"
    priority = -1  # never chosen by auto

    @staticmethod
    def get_impl_cls():
        return ToyAttentionImpl


class UnavailableAttentionBackend(TorchAttentionBackend):
    name = "toy_unavailable"

    @classmethod
    def library_reasons(cls):
        return ["toy-kernels library not installed"]


class ToyExecutor(Executor):
    name = "toy_executor"
    priority = -1

    def _init_executor(self):
        CALLS["executor"] += 1
        self.worker = Worker(self.vllm_config, self.plugin_choices)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self):
        self.worker.shutdown()


class ToyCoordinator(UnitaryKVCacheCoordinator):
    name = "toy_coordinator"
    priority = -1

    def allocate_new_blocks(self, request_id, num_tokens):
        CALLS["coordinator"] += 1
        return super().allocate_new_blocks(request_id, num_tokens)


class ToySampler(DefaultSampler):
    name = "toy_sampler"
    priority = -1

    def __call__(self, logits, metadata):
        CALLS["sampler"] += 1
        CALLS["generators"] += len(metadata.generators)  # the 1.2 view: one generator per seeded row
        return super().__call__(logits, metadata)


class ForceTokenProcessor(LogitsProcessor):
    """Requests with extra_args {"toy_force": T} can only produce token T."""

    name = "toy_force"

    @classmethod
    def requested_by(cls, params):
        return bool(params.extra_args) and "toy_force" in params.extra_args

    def apply(self, logits, rows, requests):
        CALLS["force_rows"] += len(rows)
        forced = torch.tensor([r.params.extra_args["toy_force"] for r in requests])
        logits[rows] = float("-inf")
        logits[rows, forced] = 0.0


class ToyForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        CALLS["model"] += 1
        super().__init__(config)


@hookimpl
def engine_attention_backends():
    return [ToyAttentionBackend, UnavailableAttentionBackend]


@hookimpl
def engine_executors():
    return [ToyExecutor]


@hookimpl
def engine_kv_cache_coordinators():
    return [ToyCoordinator]


@hookimpl
def engine_samplers():
    return [ToySampler]


@hookimpl
def engine_logits_processors():
    return [ForceTokenProcessor]


@hookimpl
def register_models(registry):
    registry.register_model("ToyForCausalLM", "engine_toy_plugin.plugin:ToyForCausalLM")
