#!/usr/bin/env bash
# The real-GPU acceptance harness of libvgpu.so: one command on an NVIDIA machine.
#
#   bash gpu-tests/run.sh [--lib PATH/libvgpu.so] [--out DIR] [--no-bench] [pytest args or test files...]
#
# Needs: an NVIDIA GPU and driver, gcc, python3 with pytest (PyTorch, CuPy, JAX and nvcc are
# used when present, their tests skip otherwise). No cargo, no network: libvgpu.so is built
# elsewhere (`cargo build --release -p vgpu-hook`) and passed in. Without a GPU it prints SKIP
# and exits 0. Results: DIR/pytest.log, DIR/junit.xml, DIR/bench.md, DIR/bench.json.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
lib=""
out="${OUT:-$root/gpu-tests/out}"
bench=1
pyargs=()
while [ $# -gt 0 ]; do
    case "$1" in
        --lib) lib="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --no-bench) bench=0; shift ;;
        *) pyargs+=("$1"); shift ;;
    esac
done
if [ -z "$lib" ]; then
    for c in "$root/.carry/libvgpu.so" "$root/target/release/libvgpu.so"; do
        [ -f "$c" ] && { lib="$c"; break; }
    done
fi
mkdir -p "$out"

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIP: no NVIDIA GPU here (nvidia-smi -L failed); nothing to test"
    exit 0
fi
if [ -z "$lib" ] || [ ! -f "$lib" ]; then
    echo "ERROR: libvgpu.so not found; pass --lib PATH (build it with: cargo build --release -p vgpu-hook)" >&2
    exit 2
fi
lib="$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")"

# Build the C programs against the real driver (the same sources the simulator tests use).
build="$(mktemp -d /tmp/vgpu-build.XXXXXX)"
mkdir -p "$build/lib"
libcuda="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')"
[ -z "$libcuda" ] && for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/local/cuda/compat /usr/lib64; do
    [ -e "$d/libcuda.so.1" ] && { libcuda="$d/libcuda.so.1"; break; }
done
if [ -z "$libcuda" ]; then echo "ERROR: libcuda.so.1 not found" >&2; exit 2; fi
ln -sf "$libcuda" "$build/lib/libcuda.so"
progs="$root/crates/vgpu-hook/tests/programs"
gcc -O2 -Wall -o "$build/probe" "$progs/probe.c" -I "$progs" -L "$build/lib" -lcuda -ldl -lpthread || exit 2
if command -v nvcc >/dev/null 2>&1; then
    nvcc -O2 -o "$build/runtime_probe" "$here/runtime_probe.cu" 2>"$build/nvcc.log" || echo "WARN: nvcc build failed (see $build/nvcc.log)"
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "lib: $lib ($(stat -c %s "$lib") bytes, sha256 $(sha256sum "$lib" | cut -c1-16))"
    echo "libcuda: $libcuda"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import sys; print("python", sys.version.split()[0])'
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>/dev/null
    python3 -c 'import cupy; print("cupy", cupy.__version__)' 2>/dev/null
    python3 -c 'import jax; print("jax", jax.__version__)' 2>/dev/null
    command -v nvcc >/dev/null && nvcc --version | tail -1
} | tee "$out/environment.txt"

export VGPU_LIB="$lib" VGPU_PROBE="$build/probe" VGPU_RUNTIME_PROBE="$build/runtime_probe" VGPU_OUT="$out"
export VGPU_GPU_TESTS="$here" PYTHONUNBUFFERED=1
cd "$here"
# Every module (test_two_gpus.py skips with fewer than two GPUs), unless test files are named.
modules=(test_acceptance.py test_hardening.py test_two_gpus.py)
for a in "${pyargs[@]}"; do case "$a" in *.py|*.py::*) modules=() ;; esac; done
python3 -m pytest -v -rfEs -p no:cacheprovider --junitxml="$out/junit.xml" "${pyargs[@]}" "${modules[@]}" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}

if [ "$bench" = 1 ]; then
    python3 "$here/bench.py" 2>&1 | tee "$out/bench.log"
fi
exit "$status"
