#!/usr/bin/env bash
# Checks ivme on a machine with an NVIDIA GPU and no Rust toolchain, from the release binaries
# scripts/build-gpu-check.sh builds elsewhere (gpu-bin/: ivme, harness and bench_overhead with
# CUDA, nccl/harness with NCCL, lib/ with Open MPI's libraries). Under 5 minutes; prints one
# summary table.
#
#   1. the training harness (a seeded MLP, AdamW, 16 steps) on 1 GPU in f32, bf16 and fp16,
#      against the same binary on the CPU (its default; `cpu=0` moves it) in the same precision: the sum of the
#      squared final master weights must match to 1e-4 relative in f32, 2e-2 in bf16/fp16;
#   2. the harness on 2 processes against 2 CPU processes: with 2 GPUs or more one GPU each,
#      NCCL carrying the gradients; with one GPU both ranks on it, reducing over MPI through
#      host memory (NCCL refuses two ranks on one GPU);
#   3. the overhead bench on 1 GPU (ivme's step against a hand-written candle loop, both on
#      the GPU).
#
# Usage: scripts/gpu-check.sh [BIN_DIR]     (default: ./gpu-bin)
# Needs: an NVIDIA driver and the CUDA 13 libraries (cudart, cuBLAS, cuRAND; found in
# /usr/local/cuda or LD_LIBRARY_PATH) and, for step 2, libnccl.so.2 and Open MPI's mpirun.
# What is missing is reported, not guessed around.
set -uo pipefail

BIN="$(cd "${1:-./gpu-bin}" && pwd)"
OUT="${OUT:-$(mktemp -d)}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The machine's CUDA libraries, then the bundled MPI ones (after the machine's own).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BIN/lib"
TRAIN=(opt=adamw steps=16 batch=4 n=64 lr=0.01)
ROWS=()

# A failed run's reason: its first error line, else its last line.
why() { { grep -m1 -i 'error' "$1" || tail -1 "$1"; } | cut -c1-110; }
row() { ROWS+=("$(printf '%-36s %-8s %s' "$1" "$2" "$3")"); }
die() { echo "gpu-check: $*" >&2; exit 1; }
# The harness's result line: where it trained, and the sum of squared master weights.
device_of() { grep -o 'trained on [A-Za-z]*' "$1" | head -1 | awk '{print $3}'; }
squares() { grep -o 'squared master weights [0-9.eE+-]*' "$1" | tail -1 | awk '{print $4}'; }
# Whether |a-b| <= tol*|b|.
close() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b; exit !(d <= t * m) }'; }

for b in ivme harness bench_overhead nccl/harness; do
  [ -x "$BIN/$b" ] || die "missing $BIN/$b: build it with scripts/build-gpu-check.sh and copy the folder"
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "gpu-check: $GPUS GPU(s); logs in $OUT"
missing=$(ldd "$BIN/harness" | awk '/not found/ {print $1}' | tr '\n' ' ')
[ -z "$missing" ] || die "libraries not found for the binaries: $missing(set LD_LIBRARY_PATH)"

# Compares run $2 (a log) with reference $3 (a log) at tolerance $4 under the name $1.
compare() {
  local name="$1" log="$2" ref="$3" tol="$4" got want
  got=$(squares "$log"); want=$(squares "$ref")
  if [ "$(device_of "$log")" != Cuda ]; then
    row "$name" "FAIL" "ran on $(device_of "$log"): $(why "$log")"
  elif [ -z "$want" ]; then
    row "$name" "FAIL" "no CPU reference: $(why "$ref")"
  elif [ -n "$got" ] && close "$got" "$want" "$tol"; then
    row "$name" "ok" "sum w^2 $got (CPU $want, tol $tol)"
  else
    row "$name" "FAIL" "sum w^2 ${got:-none} (CPU $want, tol $tol)"
  fi
}

for p in no bf16 fp16; do
  tol=2e-2; [ "$p" = no ] && tol=1e-4
  timeout 60 "$BIN/harness" "${TRAIN[@]}" precision=$p out="$OUT/cpu-$p" >"$OUT/cpu-$p.log" 2>&1
  timeout 60 "$BIN/harness" "${TRAIN[@]}" cpu=0 precision=$p out="$OUT/gpu-$p" >"$OUT/gpu-$p.log" 2>&1
  compare "harness, 1 GPU, precision $p" "$OUT/gpu-$p.log" "$OUT/cpu-$p.log" "$tol"
done

# Two processes: over NCCL with a GPU each where there are 2 GPUs and libnccl; otherwise the
# CUDA harness, whose ranks share the GPU(s) and reduce over MPI through host memory.
if [ "$GPUS" -ge 2 ] && ! ldd "$BIN/nccl/harness" | grep -q 'libnccl.*not found'; then
  two="$BIN/nccl/harness"; name="harness, 2 processes, 2 GPUs, NCCL"
else
  two="$BIN/harness"; name="harness, 2 processes, $GPUS GPU(s), MPI"
fi
if ! command -v mpirun >/dev/null && [ -z "${IVME_MPIRUN:-}" ]; then
  row "$name" "skipped" "no mpirun on this machine"
else
  timeout 120 "$BIN/ivme" launch --num_processes 2 "$two" "${TRAIN[@]}" \
    out="$OUT/two-cpu" >"$OUT/two-cpu.log" 2>&1
  timeout 120 "$BIN/ivme" launch --num_processes 2 "$two" "${TRAIN[@]}" cpu=0 \
    out="$OUT/two" >"$OUT/two.log" 2>&1
  compare "$name" "$OUT/two.log" "$OUT/two-cpu.log" 1e-4
fi

log="$OUT/bench.log"
if timeout 300 "$BIN/bench_overhead" 3 plain,f32,bf16 >"$log" 2>&1; then
  row "overhead bench, 1 GPU" "ok" "its lines below"
else
  row "overhead bench, 1 GPU" "FAIL" "$(why "$log")"
fi

echo
printf '%-36s %-8s %s\n' "check" "result" "detail"
printf '%s\n' "${ROWS[@]}"
echo
# The bench's own lines: each case's plain-candle step and ivme's ratios to it.
grep -E 'process|plain candle|ratio' "$log" 2>/dev/null | head -20
! printf '%s\n' "${ROWS[@]}" | grep -q FAIL
