#!/usr/bin/env bash
# Regenerates the reference fixtures under tests/fixtures/models/ with PyTorch + Hugging Face
# transformers (scripts/make_model_fixtures.py). For a person to run by hand, never CI: PyPI's
# torch wheel brings several GB of CUDA libraries. The fixtures are committed, so the Rust tests
# only read them and need no Python.
#
# For each family (llama, llama_tied, mistral, qwen2, gemma2, phi3, bert) it writes
# tests/fixtures/models/<family>/{config.json, model.safetensors, reference.safetensors}: a tiny
# randomly initialised model as transformers saves it, and one batch's inputs, logits, loss and
# the gradient of every parameter. It also rewrites tests/fixtures/models/README.md with the
# torch/transformers versions used and the conventions.
#
# Regenerate: scripts/make-model-fixtures.sh [--out DIR] [--only llama,bert]
# The virtual environment is the one scripts/bench-pytorch.sh uses ($IVME_TORCH_VENV, default
# ${TMPDIR:-/tmp}/ivme-torch-venv), made on first use.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${IVME_TORCH_VENV:-${TMPDIR:-/tmp}/ivme-torch-venv}"
if ! "$venv/bin/python" -c "import torch, transformers, accelerate, safetensors, numpy" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch transformers accelerate safetensors numpy
fi
exec "$venv/bin/python" "$here/make_model_fixtures.py" "$@"
