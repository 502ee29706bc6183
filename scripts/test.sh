#!/usr/bin/env bash
# Sets up the machine and runs the whole test suite (unit, integration, multi-process, UI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Multi-process tests run real ranks through `ivme launch`; as root Open MPI needs these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --workspace --bins --examples
cargo test --workspace
# The house rules: formatted, and no clippy warning anywhere (tests and examples included).
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
