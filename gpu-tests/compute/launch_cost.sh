#!/usr/bin/env bash
# Host time of one kernel launch (an empty kernel, back to back: probe.c's bench_launch) on
# the bare driver, under libvgpu.so without an SM limit, and with limits the loop never
# reaches (95: the limited path's bookkeeping only) or does (50: paced), alternating rounds.
#
#   bash gpu-tests/compute/launch_cost.sh <libvgpu.so> <out-dir> [rounds, default 5]
#
# TIMING_LIB=<a libvgpu.so built with `--features launch-timing`> adds one run at cap 95 under
# it and prints where the limited path's time goes (its line at exit; the build's own clock
# reads add a few hundred ns, so only the parts' proportions are the measurement).
# SHAPE="<identities> <KiB written between launches>" (e.g. "187 256") makes the loop look like
# a framework's: that many launch identities, cold caches at every launch (probe.c's
# bench_launch; only the launch calls are timed then).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LIB="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
OUT="${2:?usage: launch_cost.sh <libvgpu.so> <out-dir> [rounds]}"
ROUNDS="${3:-5}"
mkdir -p "$OUT/lib"
libcuda="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')"
ln -sf "$libcuda" "$OUT/lib/libcuda.so"
P="$ROOT/crates/vgpu-hook/tests/programs"
gcc -O2 -o "$OUT/probe" "$P/probe.c" -I "$P" -L "$OUT/lib" -lcuda -ldl -lpthread
N=50000
SHAPE="${SHAPE:-}"
: >"$OUT/launch.txt"
for r in $(seq 1 "$ROUNDS"); do
  for mode in bare unlimited cap95 cap50; do
    d="$(mktemp -d /tmp/launch-cost.XXXXXX)"
    case $mode in
      bare) v="$("$OUT/probe" bench_launch $N $SHAPE | sed -n 's/^launch_us=//p')" ;;
      unlimited) v="$(CUDA_DEVICE_MEMORY_SHARED_CACHE=$d/c LD_PRELOAD="$LIB" "$OUT/probe" bench_launch $N $SHAPE 2>/dev/null | sed -n 's/^launch_us=//p')" ;;
      cap*) v="$(CUDA_DEVICE_MEMORY_SHARED_CACHE=$d/c VGPU_TURN_DIR=$d CUDA_DEVICE_SM_LIMIT=${mode#cap} \
                 LD_PRELOAD="$LIB" "$OUT/probe" bench_launch $N $SHAPE 2>/dev/null | sed -n 's/^launch_us=//p')" ;;
    esac
    rm -rf "$d"
    echo "$r $mode $v" | tee -a "$OUT/launch.txt"
  done
done
if [ -n "${TIMING_LIB:-}" ]; then
  d="$(mktemp -d /tmp/launch-cost.XXXXXX)"
  CUDA_DEVICE_MEMORY_SHARED_CACHE=$d/c VGPU_TURN_DIR=$d CUDA_DEVICE_SM_LIMIT=95 LIBCUDA_LOG_LEVEL=3 \
    LD_PRELOAD="$TIMING_LIB" "$OUT/probe" bench_launch $N $SHAPE 2>&1 | grep -E "launch_us|launch timing" \
    | tee "$OUT/launch-timing.txt"
  rm -rf "$d"
fi
python3 - "$OUT/launch.txt" <<'PY'
import sys, statistics as st
from collections import defaultdict
v = defaultdict(list)
for line in open(sys.argv[1]):
    r, m, x = line.split()
    v[m].append(float(x))
print("| mode | µs per launch (median) | rounds |\n|---|---|---|")
for m, xs in v.items():
    print(f"| {m} | {st.median(xs):.3f} | {' '.join(f'{x:.2f}' for x in xs)} |")
PY
