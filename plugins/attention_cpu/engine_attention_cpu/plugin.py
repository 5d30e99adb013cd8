"""The ``cpu`` plugins: the paged attention backend (``attention``) and the layer kernels (``layer_kernels``,
with their linear and quantized products and the captured decode step), each kind in its own module; this
module only registers them.

The C++ kernels are compiled when this distribution is installed
(``pip install --no-build-isolation plugins/attention_cpu``); without them each reports itself unavailable and
``auto`` falls back to the core's ``torch`` backend and ``native`` kernels.
"""

from __future__ import annotations

from engine import hookimpl
from engine_attention_cpu.attention import CpuAttentionBackend
from engine_attention_cpu.layer_kernels import CpuLayerKernels

ENGINE_CONTRACT_VERSION = "1.6"


@hookimpl
def engine_attention_backends():
    return [CpuAttentionBackend]


@hookimpl
def engine_layer_kernels():
    return [CpuLayerKernels]
