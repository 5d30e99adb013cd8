"""The plugin contract: one hookspec per pluggable kind (pluggy project name ``engine``).

A plugin is a module registered under the ``engine.plugins`` entry-point group. It declares the
contract version it was built for (``ENGINE_CONTRACT_VERSION = "1.2"``; a different major version is
refused) and implements any of the hooks below with ``@engine.hookimpl``. Each hook returns a list of
implementation classes; every class carries a unique ``name``, a ``priority`` used by ``auto``, and a
classmethod ``unavailable_reasons(ctx)`` that says why it cannot run here (empty when it can).
"""
from __future__ import annotations

import pluggy

PROJECT_NAME = "engine"
CONTRACT_VERSION = "1.2"  # 1.1 added register_models, 1.2 engine_layer_kernels

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def engine_attention_backends() -> list[type]:
    """Return AttentionBackend subclasses (``engine.interfaces.attention``).

    Chosen by ``attention.backend``; ``auto`` takes the available one with the highest priority.
    """


@hookspec
def engine_executors() -> list[type]:
    """Return Executor subclasses (``engine.interfaces.executor``).

    Chosen by ``parallel.executor``; ``auto`` takes the available one with the highest priority
    (uniproc declares itself unavailable for more than one rank).
    """


@hookspec
def engine_kv_cache_coordinators() -> list[type]:
    """Return KVCacheCoordinator subclasses (``engine.interfaces.kv_cache``).

    Chosen by ``cache.kv_cache_coordinator``; ``auto`` takes the highest-priority available one whose
    ``preferred_for(ctx)`` holds for the model's KV-cache groups and the prefix-caching setting.
    """


@hookspec
def engine_samplers() -> list[type]:
    """Return Sampler subclasses (``engine.interfaces.sampler``). Chosen by ``sampler.name``."""


@hookspec
def engine_logits_processors() -> list[type]:
    """Return LogitsProcessor subclasses (``engine.interfaces.logits_processor``).

    All available ones are active; each acts only on the requests whose SamplingParams ask for it.
    """


@hookspec
def engine_layer_kernels() -> list[type]:
    """Return LayerKernels subclasses (``engine.interfaces.layer_kernels``): fused RMSNorm,
    SiLU-and-multiply and RoPE for the model layers.

    Chosen by ``device.layer_kernels``; ``auto`` takes the available one with the highest priority
    (the built-in ``native`` torch ops run everywhere).
    """


@hookspec
def register_models(registry) -> None:
    """Register model families: ``registry.register_model("Arch", cls_or_"package.module:Class")``.

    The architecture is matched on config.json's ``architectures``; a path is imported only when a model
    of that architecture loads. Plugins register after the built-ins, so they may override one.
    """


@hookspec
def engine_models() -> dict[str, type]:
    """Contract 1.0 form of ``register_models``: return ``{architecture name: model class}``."""
