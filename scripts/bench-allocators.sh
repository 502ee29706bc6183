#!/usr/bin/env bash
# The llama step (bench_llama's sizes) of plain candle and of ivme under four allocators a user
# may run with: glibc as a program starts, glibc tuned by `ivme launch`'s variables, and
# mimalloc or jemalloc as the program's own global allocator (the Accelerator's `mallopt` tunes
# glibc only). Each measurement is a process of its own, rounds alternate the order, medians.
# Usage: scripts/bench-allocators.sh [rounds=3] [sizes=S,M]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
sizes="${2:-S,M}"
bin="$(mktemp -d)"
trap 'rm -rf "$bin"' EXIT
for feature in glibc mimalloc jemalloc; do
    if [ "$feature" = glibc ]; then flags=(); else flags=(--features "$feature"); fi
    cargo build --release --quiet -p ivme-models --example bench_llama "${flags[@]}"
    cp target/release/examples/bench_llama "$bin/$feature"
done
cargo build --release --quiet -p ivme-models --example bench_llama # leave the default build
tuned=(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184)
run() { # allocator system size -> ms per step
    case "$1" in
        glibc) env -u MALLOC_MMAP_THRESHOLD_ -u MALLOC_TRIM_THRESHOLD_ "$bin/glibc" one "$2" "$3" f32 ;;
        tuned) env "${tuned[@]}" "$bin/glibc" one "$2" "$3" f32 ;;
        *) env -u MALLOC_MMAP_THRESHOLD_ -u MALLOC_TRIM_THRESHOLD_ "$bin/$1" one "$2" "$3" f32 ;;
    esac
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "llama step, f32, 1 process, $rounds rounds (medians), each measurement its own process"
echo "| size | allocator | plain candle ms/step | ivme ms/step | ivme / candle |"
echo "|---|---|---|---|---|"
for size in ${sizes//,/ }; do
    for alloc in glibc tuned mimalloc jemalloc; do
        : > "$bin/plain"; : > "$bin/ivme"
        for r in $(seq "$rounds"); do
            if [ $((r % 2)) = 1 ]; then order="plain ivme"; else order="ivme plain"; fi
            for s in $order; do run "$alloc" "$s" "$size" 2>/dev/null >> "$bin/$s"; done
        done
        p=$(median < "$bin/plain"); i=$(median < "$bin/ivme")
        awk -v s="$size" -v a="$alloc" -v p="$p" -v i="$i" \
            'BEGIN { printf "| %s | %s | %.1f | %.1f | %.2f |\n", s, a, p, i, i / p }'
    done
done
