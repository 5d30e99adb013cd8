"""Which LayerKernels the layers being built use: the model loader sets it around construction."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from engine.interfaces.layer_kernels import LayerKernels

_current: contextvars.ContextVar[LayerKernels | None] = contextvars.ContextVar("engine_layer_kernels", default=None)


@contextlib.contextmanager
def use_layer_kernels(kernels: LayerKernels) -> Iterator[None]:
    """Layers constructed inside this block call ``kernels``."""
    token = _current.set(kernels)
    try:
        yield
    finally:
        _current.reset(token)


def current_layer_kernels() -> LayerKernels:
    """The kernels set by ``use_layer_kernels``, or the native torch ops outside any such block."""
    kernels = _current.get()
    if kernels is None:
        from engine.model.layers.native_kernels import NativeLayerKernels

        kernels = NativeLayerKernels()
    return kernels
