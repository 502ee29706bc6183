#!/usr/bin/env bash
# Installs what ivme needs on a fresh Debian machine: Open MPI (the CPU multi-process
# engine), libclang (the `mpi` crate generates its bindings with it), iproute2 (`ss`: the
# restart tests check which sockets a job listens on; `ip netns`: scripts/cluster.sh),
# openssh (the sshd of each machine of scripts/cluster.sh, never started as a service) and Python's safetensors/tensorboard
# packages (interop tests read and write their files).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
need=()
for pkg in openmpi-bin libopenmpi-dev libclang-dev pkg-config iproute2 openssh-server openssh-client; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  # Installing openssh-server must not start an sshd on this machine: a policy that refuses
  # every service start stands during the install, unless the machine has one already.
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  if [ -n "$policy" ]; then $SUDO rm -f "$policy"; fi
fi
# The tracking tests read TensorBoard event files back with the reference reader.
python3 -c "import tensorboard" >/dev/null 2>&1 || python3 -m pip install --quiet tensorboard
# The checkpoint interop tests read and write model files with Python's safetensors package.
python3 -c "import safetensors, numpy" >/dev/null 2>&1 || python3 -m pip install --quiet safetensors numpy
echo "setup: $(mpirun --version 2>&1 | head -n 1)"
