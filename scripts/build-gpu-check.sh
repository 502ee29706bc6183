#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), the release binaries scripts/gpu-check.sh runs on a
# GPU machine: ivme, tutorial and bench_overhead with `--features nccl` for compute
# capability ${CUDA_COMPUTE_CAP:-90} (an H100/H200), stripped, into gpu-bin/ with the check
# script itself. Copy gpu-bin/ to the GPU machine and run `gpu-bin/gpu-check.sh gpu-bin`.
#
# The CUDA compiler comes from scripts/setup-cuda.sh (PyPI wheels, CUDA 13.0); the GPU
# machine needs an NVIDIA driver for CUDA 13 and the CUDA 13 runtime libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-cuda.sh >/dev/null
# shellcheck disable=SC1091
source "${IVME_CUDA_PREFIX:-/opt/ivme-cuda}/env.sh"
cargo build --release -p ivme --features nccl --bin ivme
cargo build --release -p ivme-suite --features nccl --example tutorial --example bench_overhead
rm -rf gpu-bin && mkdir -p gpu-bin
cp target/release/ivme target/release/examples/tutorial target/release/examples/bench_overhead gpu-bin/
strip gpu-bin/ivme gpu-bin/tutorial gpu-bin/bench_overhead
cp scripts/gpu-check.sh gpu-bin/
du -sh gpu-bin
