#!/usr/bin/env bash
# Sets up the machine and runs the whole test suite (unit, integration, multi-process, UI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One build from scratch gains nothing from incremental caches, which cost gigabytes of disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# Multi-process tests run real ranks through `ivme launch`; as root Open MPI needs these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --workspace --bins --examples
cargo test --workspace
# The house rules: formatted, and no clippy warning anywhere (tests and examples included).
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
# Only the facade's folder adds methods to the Accelerator: the parts below it receive what
# they need and never call back up (docs/ARCHITECTURE.md).
if grep -rlnE "impl(<[^>]*>)? ([A-Za-z:]+ for )?Accelerator\b" runtime/src | grep -v '^runtime/src/accelerator/'; then
  echo "test.sh: the files above write impl Accelerator outside runtime/src/accelerator/" >&2
  exit 1
fi
# Each setting is spelled once as a name, in the settings table (settings/src/table.rs).
bash scripts/check-setting-names.sh
# The published crates package (metadata, files inside each package, versioned dependencies).
cargo package -p ivme-settings -p ivme-macros-core -p ivme-macros -p ivme -p ivme-cli --no-verify --allow-dirty --quiet
