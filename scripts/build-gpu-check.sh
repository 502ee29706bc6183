#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), what scripts/gpu-check.sh runs on a GPU machine,
# for compute capability ${CUDA_COMPUTE_CAP:-90} (an H100/H200), stripped, into gpu-bin/:
#
#   ivme                       the launcher (it needs no CUDA)
#   harness, bench_overhead    `--features cuda`: the 1-GPU checks (no NCCL needed to load)
#   nccl/harness               `--features nccl`: the multi-GPU check (needs libnccl.so.2)
#   lib/                       Open MPI's shared libraries, which every binary loads
#   gpu-check.sh
#
# and packs it as gpu-bin.tar.gz (each CUDA binary is ~54 MB, mostly candle's kernels; packed,
# the whole folder is ~45 MB). On the GPU machine:
#   tar -xzf gpu-bin.tar.gz && bash gpu-bin/gpu-check.sh gpu-bin
# The CUDA compiler comes from scripts/setup-cuda.sh (PyPI wheels, CUDA 13.0); the GPU machine
# needs an NVIDIA driver for CUDA 13 and the CUDA 13 libraries (cudart, cuBLAS, cuRAND).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu-bin gpu-bin.tar.gz && mkdir -p gpu-bin/nccl gpu-bin/lib
cargo build --release -p ivme-cli --bin ivme
cp target/release/ivme gpu-bin/
bash scripts/setup-cuda.sh >/dev/null
# shellcheck disable=SC1091
source "${IVME_CUDA_PREFIX:-/opt/ivme-cuda}/env.sh"
examples=(--example harness --example bench_overhead)
cargo build --release -p ivme-suite --features nccl --example harness
cp target/release/examples/harness gpu-bin/nccl/
cargo build --release -p ivme-suite --features cuda "${examples[@]}"
cp target/release/examples/harness target/release/examples/bench_overhead gpu-bin/
strip gpu-bin/ivme gpu-bin/harness gpu-bin/bench_overhead gpu-bin/nccl/harness
# The MPI libraries the binaries load (a GPU machine may have no Open MPI).
ldd gpu-bin/harness | awk '$3 ~ /^\// {print $3}' \
  | grep -E 'libmpi|libopen-|libhwloc|libevent|libudev|libpmix' \
  | xargs -r cp -L -t gpu-bin/lib/
cp scripts/gpu-check.sh gpu-bin/
tar -czf gpu-bin.tar.gz gpu-bin
du -sh gpu-bin gpu-bin.tar.gz
