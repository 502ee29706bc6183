#!/usr/bin/env bash
# Checks ivme on a machine with an NVIDIA GPU and no Rust toolchain, from release binaries
# built elsewhere by scripts/build-gpu-check.sh (a folder holding ivme, tutorial and
# bench_overhead built with `--features nccl`). Under 5 minutes; prints one summary table.
#
#   1. the tutorial on 1 GPU in f32, bf16 and fp16, against the same binary on the CPU
#      (IVME_CPU=1): f32 must match to 1e-3 relative, bf16/fp16 to 5e-2;
#   2. with 2 GPUs or more, the tutorial on 2 processes, one GPU each, NCCL carrying the
#      gradients (ivme gives each local rank its own GPU, so this needs two); its loss is
#      checked against the CPU run on 2 processes when mpirun is there;
#   3. the overhead bench on 1 GPU (ivme's step against a hand-written candle loop, both on
#      the GPU).
#
# Usage: scripts/gpu-check.sh [BIN_DIR]     (default: ./gpu-bin)
# Needs: an NVIDIA driver, the CUDA 13 runtime libraries (cudart, cublas, curand, nvrtc) and,
# for step 2, libnccl and Open MPI's mpirun. What is missing is reported, not guessed around.
set -uo pipefail

BIN="${1:-./gpu-bin}"
OUT="${OUT:-$(mktemp -d)}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Bundled libraries (if build-gpu-check.sh copied any) come after the machine's own.
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BIN/lib"
EPOCHS=3
ROWS=()

row() { ROWS+=("$(printf '%-34s %-8s %s' "$1" "$2" "$3")"); }
die() { echo "gpu-check: $*" >&2; exit 1; }

for b in ivme tutorial bench_overhead; do
  [ -x "$BIN/$b" ] || die "missing $BIN/$b: build it with scripts/build-gpu-check.sh and copy the folder"
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "gpu-check: $GPUS GPU(s); logs in $OUT"
missing=$(ldd "$BIN/tutorial" | awk '/not found/ {print $1}' | tr '\n' ' ')
[ -z "$missing" ] || die "libraries not found for the binaries: $missing(set LD_LIBRARY_PATH)"

# The last epoch's loss a tutorial run printed.
last_loss() { grep -oE 'loss [0-9.eE+-]+' "$1" | tail -1 | awk '{print $2}'; }
# Whether |a-b| <= tol*|b|.
close() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b; exit !(d <= t * m) }'; }

timeout 120 env IVME_CPU=1 "$BIN/tutorial" "$EPOCHS" >"$OUT/cpu.log" 2>&1
ref=$(last_loss "$OUT/cpu.log")
[ -n "$ref" ] || die "the CPU reference run printed no loss: $(tail -3 "$OUT/cpu.log")"
row "tutorial, CPU reference" "ok" "loss $ref"

for p in no bf16 fp16; do
  tol=5e-2; [ "$p" = no ] && tol=1e-3
  log="$OUT/gpu-$p.log"
  if timeout 120 env IVME_PRECISION="$p" "$BIN/tutorial" "$EPOCHS" >"$log" 2>&1; then
    got=$(last_loss "$log")
    if [ -n "$got" ] && close "$got" "$ref" "$tol"; then
      row "tutorial, 1 GPU, precision $p" "ok" "loss $got (CPU $ref, tol $tol)"
    else
      row "tutorial, 1 GPU, precision $p" "FAIL" "loss ${got:-none} (CPU $ref, tol $tol)"
    fi
  else
    row "tutorial, 1 GPU, precision $p" "FAIL" "$(tail -1 "$log")"
  fi
done

if ! command -v mpirun >/dev/null; then
  row "tutorial, 2 processes, NCCL" "skipped" "no mpirun on this machine"
elif [ "$GPUS" -lt 2 ]; then
  row "tutorial, 2 processes, NCCL" "skipped" "needs 2 GPUs (one per process); $GPUS here"
else
  timeout 180 "$BIN/ivme" launch --num_processes 2 --cpu "$BIN/tutorial" "$EPOCHS" >"$OUT/two-cpu.log" 2>&1
  ref2=$(last_loss "$OUT/two-cpu.log")
  log="$OUT/two.log"
  if timeout 180 "$BIN/ivme" launch --num_processes 2 "$BIN/tutorial" "$EPOCHS" >"$log" 2>&1; then
    got=$(last_loss "$log")
    if [ -n "$got" ] && [ -n "$ref2" ] && close "$got" "$ref2" 1e-3; then
      row "tutorial, 2 processes, NCCL" "ok" "loss $got (CPU on 2: $ref2)"
    else
      row "tutorial, 2 processes, NCCL" "FAIL" "loss ${got:-none} (CPU on 2: ${ref2:-none})"
    fi
  else
    row "tutorial, 2 processes, NCCL" "FAIL" "$(tail -1 "$log")"
  fi
fi

log="$OUT/bench.log"
if timeout 150 "$BIN/bench_overhead" 3 >"$log" 2>&1; then
  row "overhead bench, 1 GPU" "ok" "see below"
else
  row "overhead bench, 1 GPU" "FAIL" "$(tail -1 "$log")"
fi

echo
printf '%-34s %-8s %s\n' "check" "result" "detail"
printf '%s\n' "${ROWS[@]}"
echo
# The bench's own lines: each case's plain-candle step and ivme's ratios to it.
grep -E 'process|plain candle|ratio' "$log" 2>/dev/null | head -20
! printf '%s\n' "${ROWS[@]}" | grep -q FAIL
