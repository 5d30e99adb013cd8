"""Builds the C++ kernels against the installed torch (install with --no-build-isolation)."""

import importlib.metadata
import os
import pathlib

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# -march=native: built on the machine that runs it (pip install builds it there); -fopenmp: at::parallel_for
# is an OpenMP pragma in a header, compiled serial without it
FLAGS = ["-O3", "-march=native", "-fopenmp"]
AVX512_VNNI_FLAGS = {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"}


def cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def simde_include_dir():
    """SIMDe's headers from the cmeel-simde wheel, or None where it is not installed."""
    try:
        path = pathlib.Path(str(importlib.metadata.distribution("cmeel-simde").locate_file("cmeel.prefix/include")))
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(path) if (path / "simde" / "x86" / "avx512.h").exists() else None


def emulated_extensions():
    """On a CPU without AVX-512 VNNI, the decode attention, the GEMM and the quantized kernels a second time with
    SIMDe's AVX-512 (tests only): the avx512 and avx512vnni variants' code is then tested on this machine too.
    ENGINE_BUILD_EMULATED=1 builds them on any CPU (to check that build where the CPU has the instructions)."""
    include = simde_include_dir()
    forced = os.environ.get("ENGINE_BUILD_EMULATED") == "1"
    if include is None or (AVX512_VNNI_FLAGS <= cpu_flags() and not forced):
        return []

    def emulated(name, sources, *flags):
        return CppExtension(
            f"engine_attention_cpu.{name}",
            [f"engine_attention_cpu/csrc/emulated/{source}" for source in sources.split()],
            include_dirs=[include],
            extra_compile_args=FLAGS + ["-DENGINE_EMULATE_AVX512", *flags],
            extra_link_args=["-fopenmp"],
        )

    return [
        emulated("_C_emulated", "paged_attention.cpp prefill_attention.cpp"),
        emulated("_gemm_emulated", "gemm.cpp"),
        emulated("_quant_emulated", "quant_gemm.cpp", "-ffp-contract=off"),
        emulated("_moe_emulated", "fused_moe.cpp"),
    ]


# every file of csrc/ may be compiled into several extensions (shared headers and .inc loops; paged_attention.cpp into
# the decode graph's and the emulated builds): a change to any of them rebuilds them all (setuptools compares only
# each extension's own sources' times otherwise, and an edited header left a stale kernel in place)
CSRC = pathlib.Path("engine_attention_cpu/csrc")
KERNEL_FILES = sorted(str(path) for path in CSRC.rglob("*") if path.suffix in {".h", ".inc", ".cpp"})


class ParallelBuildExtension(BuildExtension):
    """Compiles the extensions side by side, one per core (on 2 cores about half the time). Without ninja: torch's
    ninja path writes one build.ninja per build folder, which two extensions built at once would share. The emulated
    builds compile wrappers in csrc/emulated/, so no two extensions write the same object file."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, use_ninja=False, **kwargs)

    def finalize_options(self):
        super().finalize_options()
        for extension in self.extensions:
            extension.depends = sorted(set(extension.depends) | set(KERNEL_FILES))
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


setup(
    ext_modules=[
        CppExtension(
            "engine_attention_cpu._C",
            ["engine_attention_cpu/csrc/paged_attention.cpp", "engine_attention_cpu/csrc/prefill_attention.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # MLA's decode over the paged latent cache (absorbed form)
        CppExtension(
            "engine_attention_cpu._mla",
            ["engine_attention_cpu/csrc/mla_decode.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # no fused multiply-add: the layer kernels round where the torch ops they replace round
        CppExtension(
            "engine_attention_cpu._layers",
            ["engine_attention_cpu/csrc/layer_kernels.cpp"],
            extra_compile_args=FLAGS + ["-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
        ),
        CppExtension(
            "engine_attention_cpu._gemm",
            ["engine_attention_cpu/csrc/gemm.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # the integer-dot kernels of quantized weights (per-function ISA targets, chosen at run time); no contraction
        # into fused multiply-adds beyond the explicit ones, so every tile shape rounds alike (rows batch-invariant)
        CppExtension(
            "engine_attention_cpu._quant",
            ["engine_attention_cpu/csrc/quant_gemm.cpp"],
            extra_compile_args=FLAGS + ["-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
        ),
        # the fused mixture-of-experts operation (compiles gemm.cpp in, bindings left out)
        CppExtension(
            "engine_attention_cpu._moe",
            ["engine_attention_cpu/csrc/fused_moe.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # the batched LoRA product (shrink and expand per adapter slot, B's zero blocks skipped)
        CppExtension(
            "engine_attention_cpu._lora",
            ["engine_attention_cpu/csrc/lora.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # Mamba's convolution and selective scans (hybrid models' state-space layers)
        CppExtension(
            "engine_attention_cpu._mamba",
            ["engine_attention_cpu/csrc/mamba.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # the decode step captured in C++: compiles the kernel sources above in (GEMM, attention, layer, integer-dot
        # and LoRA kernels; their bindings left out), each with its own contraction setting (pragmas), so a replayed
        # step calls the same code as the eager layers
        CppExtension(
            "engine_attention_cpu._graph",
            ["engine_attention_cpu/csrc/decode_graph.cpp"],
            extra_compile_args=FLAGS,
            extra_link_args=["-fopenmp"],
        ),
    ]
    + emulated_extensions(),
    cmdclass={"build_ext": ParallelBuildExtension},
)
