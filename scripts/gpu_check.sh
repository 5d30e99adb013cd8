#!/usr/bin/env bash
# GPU check (a CUDA machine, under 8 minutes): install the CUDA backends' libraries where wheels
# exist, run every GPU-gated test, then the A/B of the attention backends (parity + throughput).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m pip install --quiet flashinfer-python || echo "flashinfer-python: no wheel here (its tests skip)"
python -m pip install --quiet --no-build-isolation flash-attn || echo "flash-attn: no wheel here (its tests skip)"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
timeout 300 python -m pytest -q -rs tests/test_attention_backends.py -k "flash or flashinfer or triton"
timeout 200 python scripts/attention_ab.py --backends torch,triton,flash,flashinfer --requests 32 --dtype bfloat16
