#!/usr/bin/env bash
# Installs a CUDA toolkit (nvcc + headers + the libraries candle/cudarc link against) from
# PyPI wheels only, into a prefix, and lays it out like a conventional toolkit:
#
#   $PREFIX/venv                  Python venv the nvidia-* wheels are pip-installed into
#   $PREFIX/cuda/bin              -> the wheels' bin (nvcc, ptxas, fatbinary, nvlink, ...)
#   $PREFIX/cuda/nvvm             -> the wheels' nvvm (cicc, libdevice)
#   $PREFIX/cuda/include          runtime/crt/cccl/cublas/curand/nvrtc headers + nccl.h
#   $PREFIX/cuda/lib64            libcudart, libcublas(Lt), libcurand, libnvrtc, libnccl (+ .so links)
#   $PREFIX/cuda/lib64/stubs      libcuda.so: a generated driver-API stub, for linking only
#   $PREFIX/env.sh                the environment to source before `cargo build --features cuda`
#
# Enough for candle-core's `cuda` feature (candle-kernels runs nvcc on .cu files that include
# cuda_fp16.h / cuda_bf16.h / cuda_fp8.h, to PTX and to a static lib) and cudarc 0.19's
# `cuda-version-from-build-system` + `dynamic-linking` (nvcc --version, -lcuda -lcudart
# -lcublas -lcublasLt -lcurand -lnvrtc, -lnccl with candle's `nccl` feature).
#
# Why CUDA 13.0: the cu12 nvcc wheels (nvidia-cuda-nvcc-cu12, all 12.x) ship only ptxas and
# libnvvm, no nvcc/cicc; a complete nvcc is on PyPI only from 13.0 on. 13.0 (not newer) keeps
# the generated PTX loadable by the oldest CUDA 13 drivers (>= 580), and cudarc 0.19.10 knows
# CUDA <= 13.4 and NCCL <= 2.30 (its `nccl` feature binds 2.30). The pins are the ones of
# NVIDIA's cuda-toolkit 13.0.3.0 metapackage.
#
# No wheel ships the driver (libcuda.so.1) or its link stub, so the stub is generated from
# cuda.h: every driver-API entry point, each returning CUDA_ERROR_STUB_LIBRARY (34). It is
# named libcuda.so (soname libcuda.so.1) and lives only in lib64/stubs, which is on
# LIBRARY_PATH but never on LD_LIBRARY_PATH, so at run time the real driver is loaded.
#
# Usage: scripts/setup-cuda.sh            (rerunnable; IVME_CUDA_PREFIX overrides the prefix)
#        source "${IVME_CUDA_PREFIX:-/opt/ivme-cuda}/env.sh"
set -euo pipefail

PREFIX="${IVME_CUDA_PREFIX:-/opt/ivme-cuda}"
CUDA="$PREFIX/cuda"
VENV="$PREFIX/venv"
COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"

WHEELS=(
  nvidia-cuda-nvcc==13.0.88     # nvcc, ptxas, fatbinary, nvlink, cudafe++, bin2c
  nvidia-cuda-crt==13.0.88      # include/crt/*
  nvidia-nvvm==13.0.88          # nvvm/bin/cicc, libdevice, libnvvm
  nvidia-cuda-runtime==13.0.96  # cuda_runtime.h, cuda.h, cuda_fp16/bf16/fp8.h, libcudart
  nvidia-cuda-cccl==13.0.85     # include/cccl (cub, thrust, libcu++)
  nvidia-cuda-nvrtc==13.0.88    # libnvrtc
  nvidia-cublas==13.1.1.3       # libcublas, libcublasLt
  nvidia-curand==10.4.0.35      # libcurand
  nvidia-nccl-cu13==2.30.7      # libnccl, nccl.h
)

log() { echo "setup-cuda: $*"; }
die() { echo "setup-cuda: ERROR: $*" >&2; exit 1; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || die "only Linux x86_64 is supported (this is $(uname -s)-$(uname -m))"
command -v python3 >/dev/null || die "python3 not found"
command -v gcc >/dev/null || die "gcc not found (nvcc needs a host compiler): apt-get install -y build-essential"
command -v g++ >/dev/null || die "g++ not found (nvcc needs a host C++ compiler): apt-get install -y g++"

# ---------------------------------------------------------------- 1. venv + wheels
mkdir -p "$PREFIX" 2>/dev/null || $SUDO mkdir -p "$PREFIX" || die "cannot create $PREFIX"
[ -w "$PREFIX" ] || die "$PREFIX is not writable (run as root or set IVME_CUDA_PREFIX)"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
    log "python3 -m venv failed; installing python3-venv"
    rm -rf "$VENV"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null \
      || die "apt-get install python3-venv failed"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed even with python3-venv"
  fi
fi
PY="$VENV/bin/python"

missing_wheels() {
  local have w
  have="$("$PY" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null | tr 'A-Z_' 'a-z-')"
  for w in "${WHEELS[@]}"; do
    grep -qxF "$w" <<<"$have" || echo "$w"
  done
}
need="$(missing_wheels)"
if [ -n "$need" ]; then
  avail_kb="$(df -Pk "$PREFIX" | awk 'NR==2 {print $4}')"
  [ "$avail_kb" -ge $((4 * 1024 * 1024)) ] || die "less than 4 GiB free under $PREFIX ($((avail_kb / 1024)) MiB)"
  log "pip-installing $(echo $need | wc -w) wheel(s) into $VENV (about 1 GB to download)"
  # --no-deps: every piece is pinned above, nothing else may float in.
  # --no-cache-dir: the wheels are not kept twice on disk.
  "$PY" -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps \
    --only-binary=:all: "${WHEELS[@]}" || die "pip install of the CUDA wheels failed"
  need="$(missing_wheels)"
  [ -z "$need" ] || die "after pip install these pins are still not installed: $need"
else
  log "all ${#WHEELS[@]} wheels already installed in $VENV"
fi

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
CU="$SITE/nvidia/cu13"
[ -d "$CU" ] || die "$CU missing: the CUDA 13 wheels did not install where expected"
NCCL_H="$(find "$SITE/nvidia" -name nccl.h -path '*/include/*' 2>/dev/null | head -n 1 || true)"
[ -n "$NCCL_H" ] || die "nccl.h not found in the nvidia-nccl-cu13 wheel"
NCCL_DIR="$(dirname "$(dirname "$NCCL_H")")"

for f in bin/nvcc bin/nvcc.profile bin/ptxas bin/fatbinary bin/nvlink bin/cudafe++ nvvm/bin/cicc \
         nvvm/libdevice/libdevice.10.bc include/cuda.h include/cuda_runtime.h include/cuda_fp16.h \
         include/cuda_bf16.h include/cuda_fp8.h include/crt/host_config.h include/cublas_v2.h \
         include/curand.h include/nvrtc.h lib/libcudart.so.13 lib/libcublas.so.13 \
         lib/libcublasLt.so.13 lib/libcurand.so.10 lib/libnvrtc.so.13; do
  [ -e "$CU/$f" ] || die "missing from the wheels: $CU/$f"
done
[ -d "$CU/include/cccl" ] || die "missing from the wheels: $CU/include/cccl"
ls "$NCCL_DIR"/lib/libnccl.so* >/dev/null 2>&1 || die "libnccl.so* not found in $NCCL_DIR/lib"

# ---------------------------------------------------------------- 2. toolkit layout
# Built afresh in a temporary directory and swapped in, so a rerun repairs a broken tree.
NEW="$PREFIX/.cuda.new"
rm -rf "$NEW"
mkdir -p "$NEW/include" "$NEW/lib64/stubs"
# nvcc resolves its own location, so bin/nvvm can be links: nvcc.profile then finds
# include/, nvvm/ and lib/ next to the real binary.
ln -s "$CU/bin" "$NEW/bin"
ln -s "$CU/nvvm" "$NEW/nvvm"
ln -s lib64 "$NEW/lib"
for d in "$CU/include" "$NCCL_DIR/include"; do
  for e in "$d"/*; do
    [ -e "$NEW/include/$(basename "$e")" ] || ln -s "$e" "$NEW/include/$(basename "$e")"
  done
done
for d in "$CU/lib" "$NCCL_DIR/lib"; do
  for e in "$d"/lib*; do
    [ -f "$e" ] || continue
    ln -sf "$e" "$NEW/lib64/$(basename "$e")"
  done
done
# Wheels carry no symlinks: add the unversioned names the linker's -lfoo looks for.
for e in "$NEW"/lib64/lib*.so.*; do
  b="$(basename "$e")"
  base="${b%%.so.*}.so"
  [ -e "$NEW/lib64/$base" ] || ln -s "$b" "$NEW/lib64/$base"
done

# libcuda.so link stub: a wheel's own if one ever ships it, else generated from cuda.h.
STUB_SRC="$(find "$SITE/nvidia" -path '*/stubs/libcuda.so' 2>/dev/null | head -n 1 || true)"
if [ -n "$STUB_SRC" ]; then
  log "using the libcuda stub shipped in $STUB_SRC"
  cp "$STUB_SRC" "$NEW/lib64/stubs/libcuda.so"
else
  GEN="$PREFIX/.stubgen"
  rm -rf "$GEN"; mkdir -p "$GEN"
  # cudaProfiler.h is in no wheel: its three functions are added by name below.
  printf '#include <cuda.h>\n' >"$GEN/all.h"
  [ -e "$CU/include/cudaProfiler.h" ] && printf '#include <cudaProfiler.h>\n' >>"$GEN/all.h"
  # Three views of cuda.h: the default names (cuMemAlloc_v2, cuCtxCreate_v4, ...), the
  # per-thread-default-stream names (_ptds/_ptsz) and the legacy unversioned names.
  : >"$GEN/pre.i"
  for defs in "" "-DCUDA_API_PER_THREAD_DEFAULT_STREAM" "-D__CUDA_API_VERSION_INTERNAL"; do
    # shellcheck disable=SC2086
    gcc -E -P $defs -I"$CU/include" "$GEN/all.h" >>"$GEN/pre.i" || die "preprocessing cuda.h for the stub failed"
  done
  "$PY" - "$GEN/pre.i" "$GEN/libcuda_stub.c" <<'EOF' || die "generating the libcuda stub source failed"
import re, sys
text = re.sub(r"\s+", " ", open(sys.argv[1]).read())
names = {"cuProfilerInitialize", "cuProfilerStart", "cuProfilerStop"}
for stmt in text.split(";"):
    s = stmt.strip()
    if s.startswith("typedef") or "{" in s:
        s = s.rsplit("}", 1)[-1].strip()
        if s.startswith("typedef") or not s:
            continue
    m = re.search(r"\b(cu[A-Z][A-Za-z0-9_]*)\s*\(", s)
    if m and not re.search(r"\(\s*\*", s[:m.start()]):
        names.add(m.group(1))
if len(names) < 300:
    sys.exit(f"only {len(names)} driver entry points found in cuda.h")
with open(sys.argv[2], "w") as out:
    out.write("/* Generated by scripts/setup-cuda.sh: link-time stub of the CUDA driver API. */\n")
    out.write("#define STUB(n) __attribute__((visibility(\"default\"))) int n(void) { return 34; /* CUDA_ERROR_STUB_LIBRARY */ }\n")
    for n in sorted(names):
        out.write(f"STUB({n})\n")
print(f"setup-cuda: generated a libcuda stub with {len(names)} driver entry points")
EOF
  gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$NEW/lib64/stubs/libcuda.so" "$GEN/libcuda_stub.c" \
    || die "compiling the libcuda stub failed"
  cp "$GEN/libcuda_stub.c" "$NEW/lib64/stubs/libcuda_stub.c"
  rm -rf "$GEN"
fi
nm -D --defined-only "$NEW/lib64/stubs/libcuda.so" | grep -w cuInit >/dev/null || die "libcuda stub lacks cuInit"

rm -rf "$CUDA"
mv "$NEW" "$CUDA"

# ---------------------------------------------------------------- 3. environment
cat >"$PREFIX/env.sh" <<EOF
# Generated by scripts/setup-cuda.sh: source this before building with --features cuda.
export CUDA_PATH="$CUDA"
export CUDA_ROOT="$CUDA"
export CUDA_HOME="$CUDA"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-$COMPUTE_CAP}"
case ":\${PATH:-}:" in *":$CUDA/bin:"*) ;; *) export PATH="$CUDA/bin\${PATH:+:\$PATH}" ;; esac
case ":\${LD_LIBRARY_PATH:-}:" in *":$CUDA/lib64:"*) ;; *) export LD_LIBRARY_PATH="$CUDA/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" ;; esac
case ":\${LIBRARY_PATH:-}:" in *":$CUDA/lib64/stubs:"*) ;; *) export LIBRARY_PATH="$CUDA/lib64:$CUDA/lib64/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}" ;; esac
EOF
# shellcheck disable=SC1091
. "$PREFIX/env.sh"

# ---------------------------------------------------------------- 4. verification
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT

[ "$(command -v nvcc)" = "$CUDA/bin/nvcc" ] || die "nvcc on PATH is $(command -v nvcc), not $CUDA/bin/nvcc"
nvcc --version >"$T/nvcc-version" 2>&1 || { cat "$T/nvcc-version" >&2; die "nvcc --version failed"; }
# cudarc 0.19 reads the 4th line: "Cuda compilation tools, release X.Y, VX.Y.Z".
release="$(sed -n 4p "$T/nvcc-version" | awk -F', ' '{print $2}' | awk '{print $2}')"
case "$release" in
  12.[0-689]|13.[0-4]) ;;
  *) cat "$T/nvcc-version" >&2; die "nvcc reports release '$release', which cudarc 0.19 cannot use" ;;
esac

cat >"$T/k.cu" <<'EOF'
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
extern "C" __global__ void mix(const __half *a, const __nv_bfloat16 *b, __nv_fp8_e4m3 *q,
                               float *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  __half h = a[i] * a[i] + __float2half(1.0f);
  __nv_bfloat16 g = b[i] * b[i] - __float2bfloat16(0.5f);
  float f = __half2float(h) + __bfloat162float(g);
  q[i] = __nv_fp8_e4m3(f);
  out[i] = f + static_cast<float>(q[i]) + __half2float(__hmax(h, __float2half(f)));
}
EOF
NVFLAGS=(-std=c++17 --expt-relaxed-constexpr -O3)
nvcc "${NVFLAGS[@]}" --ptx -arch=sm_$COMPUTE_CAP "$T/k.cu" -o "$T/k.ptx" >"$T/ptx.log" 2>&1 \
  || { cat "$T/ptx.log" >&2; die "nvcc --ptx -arch=sm_$COMPUTE_CAP failed on the fp16/bf16/fp8 test kernel"; }
grep -q "^\.target sm_$COMPUTE_CAP" "$T/k.ptx" || die "PTX has no '.target sm_$COMPUTE_CAP'"
grep -q "\.entry mix" "$T/k.ptx" || die "PTX has no entry 'mix'"
nvcc "${NVFLAGS[@]}" -cubin -gencode "arch=compute_$COMPUTE_CAP,code=sm_$COMPUTE_CAP" "$T/k.cu" -o "$T/k.cubin" >"$T/cubin.log" 2>&1 \
  || { cat "$T/cubin.log" >&2; die "nvcc -cubin (ptxas) failed"; }
# Like candle-kernels' libmoe.a: an object with host code, through g++, -fPIC.
nvcc "${NVFLAGS[@]}" -c -gencode "arch=compute_$COMPUTE_CAP,code=sm_$COMPUTE_CAP" -Xcompiler -fPIC "$T/k.cu" -o "$T/k.o" >"$T/obj.log" 2>&1 \
  || { cat "$T/obj.log" >&2; die "nvcc -c (host compile + fatbinary) failed"; }

# Link what cudarc's dynamic-linking + candle-kernels ask for, through LIBRARY_PATH only.
cat >"$T/link.c" <<'EOF'
#include <stdio.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <curand.h>
#include <nvrtc.h>
#include <nccl.h>
int main(void) {
  int rt = 0, nc = 0, cu = 0, cl = 0, ma = 0, mi = 0;
  CUresult r = cuInit(0);
  cudaRuntimeGetVersion(&rt);
  ncclGetVersion(&nc);
  curandGetVersion(&cu);
  nvrtcVersion(&ma, &mi);
  cublasGetProperty(MAJOR_VERSION, &cl);
  printf("cuInit=%d cudart=%d nccl=%d curand=%d nvrtc=%d.%d cublas=%d cublasLt=%zu\n",
         (int)r, rt, nc, cu, ma, mi, cl, cublasLtGetVersion());
  return 0;
}
EOF
gcc -I"$CUDA/include" "$T/link.c" -o "$T/link" -lcuda -lcudart -lcublas -lcublasLt -lcurand -lnvrtc -lnccl \
  -lstdc++ >"$T/link.log" 2>&1 || { cat "$T/link.log" >&2; die "linking -lcuda -lcudart -lcublas -lcublasLt -lcurand -lnvrtc -lnccl failed"; }
readelf -d "$T/link" | grep 'NEEDED.*\[libcuda\.so\.1\]' >/dev/null || die "test binary does not need libcuda.so.1"
# Run it against the stub (as libcuda.so.1 in a scratch dir) where no driver is installed.
if ! ldconfig -p 2>/dev/null | grep 'libcuda\.so\.1 ' >/dev/null; then
  mkdir -p "$T/drv" && ln -s "$CUDA/lib64/stubs/libcuda.so" "$T/drv/libcuda.so.1"
  run_out="$(LD_LIBRARY_PATH="$T/drv:$LD_LIBRARY_PATH" "$T/link" 2>&1)" || die "test binary failed to run: $run_out"
else
  run_out="$("$T/link" 2>&1 || true)"
fi
log "libraries: $run_out"

# Every driver function cudarc binds must be in the stub (checked when its source is at hand).
cudarc_sys="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -n 1 || true)"
if [ -n "$cudarc_sys" ]; then
  nm -D --defined-only "$CUDA/lib64/stubs/libcuda.so" | awk '{print $3}' | sort -u >"$T/stub.syms"
  feat="cuda-${release%%.*}0${release#*.}0"
  # A function counts when it has no #[cfg] line or its #[cfg] names this toolkit's feature.
  awk -v feat="\"$feat\"" '
    /^pub unsafe fn cu/ {
      if (prev !~ /^#\[cfg/ || index(prev, feat)) { n = $4; sub(/\(.*/, "", n); print n }
    }
    { prev = $0 }' "$cudarc_sys" | sort -u >"$T/cudarc.syms"
  [ -s "$T/cudarc.syms" ] || die "found no driver functions in $cudarc_sys"
  lacking="$(comm -23 "$T/cudarc.syms" "$T/stub.syms" | tr '\n' ' ')"
  [ -z "$lacking" ] || die "libcuda stub lacks functions cudarc binds: $lacking"
  log "stub covers all $(wc -l <"$T/cudarc.syms") driver functions of $(basename "$(dirname "$(dirname "$(dirname "$(dirname "$cudarc_sys")")")")")"
fi

log "OK: $(sed -n 4p "$T/nvcc-version"); test kernel compiled to PTX/cubin/object for sm_$COMPUTE_CAP"
log "prefix $PREFIX uses $(du -sh "$PREFIX" | cut -f1)"
echo "# Add to your shell (or: source $PREFIX/env.sh):"
echo "export CUDA_PATH=$CUDA"
echo "export CUDA_ROOT=$CUDA"
echo "export CUDA_HOME=$CUDA"
echo "export CUDA_COMPUTE_CAP=$COMPUTE_CAP"
echo "export PATH=$CUDA/bin:\$PATH"
echo "export LD_LIBRARY_PATH=$CUDA/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export LIBRARY_PATH=$CUDA/lib64:$CUDA/lib64/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
