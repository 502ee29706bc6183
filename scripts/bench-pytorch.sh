#!/usr/bin/env bash
# Runs scripts/bench_pytorch.py (the llama benchmarks' step in PyTorch and PyTorch + Accelerate)
# in a virtual environment of its own, made on first use. Not part of CI: PyPI's torch wheel
# brings several GB of CUDA libraries. Usage: scripts/bench-pytorch.sh [--rounds 3]
# [--sizes T,S,M] [--processes 1|2]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${IVME_TORCH_VENV:-${TMPDIR:-/tmp}/ivme-torch-venv}"
if ! "$venv/bin/python" -c "import torch, transformers, accelerate" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch transformers accelerate
fi
exec "$venv/bin/python" "$here/bench_pytorch.py" "$@"
