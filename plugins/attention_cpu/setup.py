"""Builds the C++ kernel against the installed torch (install with --no-build-isolation)."""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[CppExtension(
        "engine_attention_cpu._C", ["engine_attention_cpu/csrc/paged_attention.cpp"],
        # -march=native: built on the machine that runs it (pip install builds it there); -fopenmp: at::parallel_for
        # is an OpenMP pragma in a header, compiled serial without it
        extra_compile_args=["-O3", "-march=native", "-fopenmp"], extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": BuildExtension},
)
