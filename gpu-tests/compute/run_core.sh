#!/usr/bin/env bash
# The compute bench's core set in one device call: builds HAMi-core's libvgpu.so from
# .carry/hami-core (build_hami.sh), then runs run.py (see its docstring) against vgpu's
# library, HAMi-core's and plain time-slicing, 2 rounds of 5 s windows, within $BUDGET
# seconds (default 500; with the build and run.py's 30 s hard grace, inside a 10-minute call).
#
#   bash gpu-tests/compute/run_core.sh <dir-with-vgpu's-libvgpu.so> <out-dir> [run.py options]
#
# The vgpu CLI next to the library (<dir>/vgpu), when there, gives `vgpu status` snapshots.
# If HAMi-core does not build, the bench runs without the hami mode (the build's errors are
# printed and kept in <out-dir>/hami-build.log). The spin tenant needs no build: it compiles
# spin.cu's kernel with cupy at run time. Extra options go to run.py (e.g. --scenarios all,
# --rounds 3, --seconds 8).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LIBDIR="$(cd "${1:?usage: run_core.sh <dir-with-libvgpu.so> <out-dir> [run.py options]}" && pwd)"
OUTDIR="${2:?usage: run_core.sh <dir-with-libvgpu.so> <out-dir> [run.py options]}"
shift 2
LIB="$LIBDIR/libvgpu.so"
[ -f "$LIB" ] || { echo "run_core.sh: no $LIB" >&2; exit 2; }
mkdir -p "$OUTDIR"
HAMI_SRC="${HAMI_SRC:-$ROOT/.carry/hami-core}"
echo "[$(date +%T)] building HAMi-core from $HAMI_SRC"
HAMI=()
if HAMI_LIB="$(bash "$HERE/build_hami.sh" "$HAMI_SRC" "$OUTDIR/hami" 2>"$OUTDIR/hami-build.log")"; then
  HAMI=(--hami-lib "$(tail -n 1 <<<"$HAMI_LIB")")
  echo "[$(date +%T)] HAMi-core: ${HAMI[1]}"
else
  tail -n 80 "$OUTDIR/hami-build.log" >&2
  echo "[$(date +%T)] HAMi-core did not build: running without the hami mode" >&2
fi
CLI=()
[ -x "$LIBDIR/vgpu" ] && CLI=(--vgpu "$LIBDIR/vgpu")
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,temperature.gpu --format=csv \
  | tee "$OUTDIR/gpu.txt" || true
exec python3 -u "$HERE/run.py" --vgpu-lib "$LIB" ${HAMI[@]+"${HAMI[@]}"} ${CLI[@]+"${CLI[@]}"} \
  --out "$OUTDIR" --budget "${BUDGET:-500}" --seconds 5 --rounds 2 "$@"
