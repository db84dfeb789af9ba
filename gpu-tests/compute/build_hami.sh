#!/usr/bin/env bash
# Builds HAMi-core's libvgpu.so from its public source, for the compute bench's `hami` mode.
#
#   bash gpu-tests/compute/build_hami.sh <hami-core source> <outdir>
#
# Prints the library's path (<outdir>/libvgpu.so) as its last line on stdout; exits 2 with
# the configure or compiler output when it does not build. The source is copied first, so the
# build writes nothing into it, and HAMi-core's own test programs (test/, which need FindCUDA
# and nvcc) are left out of the copy: the bench needs the library only. The compile
# definitions and the build type are build.sh's, what HAMi ships: Debug. (CMakeLists' Release
# flags add -fvisibility=hidden, which leaves only dlsym exported: a preloaded Release build
# intercepts nothing. HAMI_BUILD_TYPE overrides; the export check below refuses such a
# library.) CUDA comes from $CUDA_HOME
# (default /usr/local/cuda); the link against libcuda and libnvidia-ml uses the toolkit's
# stubs where the driver's unversioned names are missing (their SONAMEs load the driver's).
set -euo pipefail
SRC="${1:?usage: build_hami.sh <hami-core source> <outdir>}"
OUTDIR="${2:?usage: build_hami.sh <hami-core source> <outdir>}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
BUILD_TYPE="${HAMI_BUILD_TYPE:-Debug}"
fail() { echo "build_hami.sh: $*" >&2; exit 2; }

[ -f "$SRC/CMakeLists.txt" ] && [ -d "$SRC/src" ] || fail "$SRC is not HAMi-core's source (no CMakeLists.txt and src/)"
for h in cuda.h nvml.h; do
  [ -f "$CUDA_HOME/include/$h" ] || fail "no $CUDA_HOME/include/$h (set CUDA_HOME)"
done
command -v cmake >/dev/null || fail "no cmake on PATH"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="$(mktemp -d)"
trap '[ -n "${HAMI_KEEP_BUILD:-}" ] || rm -rf "$WORK"' EXIT
cp -r "$SRC/." "$WORK/src"
rm -rf "$WORK/src/build"
sed -i '/add_subdirectory *( *test *)/d' "$WORK/src/CMakeLists.txt"
export CUDA_HOME
export LIBRARY_PATH="$CUDA_HOME/lib64/stubs:$CUDA_HOME/targets/x86_64-linux/lib/stubs:$CUDA_HOME/lib64${LIBRARY_PATH:+:$LIBRARY_PATH}"
LOG="$WORK/build.log"
echo "+ cmake configure ($BUILD_TYPE, CUDA_HOME=$CUDA_HOME, $(cmake --version | head -1))" >&2
# CMAKE_POLICY_VERSION_MINIMUM: HAMi-core asks for CMake 2.8.11, which CMake 4 refuses.
if ! cmake -S "$WORK/src" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    -DDLSYM_HOOK_ENABLE=1 -DMULTIPROCESS_LIMIT_ENABLE=1 -DHOOK_MEMINFO_ENABLE=1 \
    -DHOOK_NVML_ENABLE=1 -DTEST_DEVICE_ID=0 >"$LOG" 2>&1; then
  cat "$LOG" >&2
  fail "cmake configure failed"
fi
echo "+ cmake build" >&2
if ! cmake --build "$WORK/build" --target vgpu -j "$(nproc)" >>"$LOG" 2>&1; then
  tail -n 60 "$LOG" >&2
  echo "--- the build's errors (its warnings left out):" >&2
  grep -E -B2 -A4 "error|Error [0-9]" "$LOG" | head -n 120 >&2
  fail "the build failed (compiler output above; the whole log: rerun with HAMI_KEEP_BUILD=1)"
fi
LIB="$WORK/build/libvgpu.so"
[ -f "$LIB" ] || { tail -n 50 "$LOG" >&2; fail "the build left no libvgpu.so"; }
EXPORTS="$(nm -D --defined-only "$LIB")"
for sym in cuLaunchKernel cuInit nvmlDeviceGetProcessUtilization dlsym; do
  grep -qw "$sym" <<<"$EXPORTS" || fail "libvgpu.so does not export $sym (build type $BUILD_TYPE)"
done
cp "$LIB" "$OUTDIR/libvgpu.so.tmp" && mv "$OUTDIR/libvgpu.so.tmp" "$OUTDIR/libvgpu.so"
echo "$OUTDIR/libvgpu.so"
