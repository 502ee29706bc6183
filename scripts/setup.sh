#!/usr/bin/env bash
# Installs what ivme needs on a fresh Debian machine: Open MPI (the CPU multi-process
# engine), libclang (the `mpi` crate generates its bindings with it) and Python's
# safetensors/tensorboard packages (interop tests read and write their files).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -f /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -f /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || need+=(libopenmpi-dev)
ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 || ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" libopenmpi-dev openmpi-bin libclang-dev pkg-config >/dev/null
fi
# The tracking tests read TensorBoard event files back with the reference reader.
python3 -c "import tensorboard" >/dev/null 2>&1 || python3 -m pip install --quiet tensorboard
# The checkpoint interop tests read and write model files with Python's safetensors package.
python3 -c "import safetensors, numpy" >/dev/null 2>&1 || python3 -m pip install --quiet safetensors numpy
echo "setup: $(mpirun --version 2>&1 | head -n 1)"
