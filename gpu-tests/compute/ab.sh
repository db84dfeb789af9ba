#!/usr/bin/env bash
# Two (or more) builds of libvgpu.so on the same scenarios in alternating rounds: run.py takes
# one library, so each round runs it once per build, in a rotated order, each invocation with
# its own alone runs (every percentage is against the alone run of its own invocation). Then
# ab_summary.py prints, per build, scenario, mode and tenant, the median over rounds of thr %
# and GPU %, with every round's value.
#
#   bash gpu-tests/compute/ab.sh <out> <rounds> <scenarios> <modes> NAME=lib.so [NAME=lib.so ...]
#
# e.g. bash gpu-tests/compute/ab.sh $OUT/ab 3 solo-resnet18-95 alone,vgpu-nolimit,vgpu-cap \
#        main=.carry/m1/libvgpu.so new=.carry/m2/libvgpu.so
# Extra run.py options go in RUN_OPTS (default: "--seconds 4 --no-overlap"); a build's own
# environment (a diagnostic build's VGPU_DIAG_*) as NAME=lib.so@VAR=value[,VAR=value].
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:?usage: ab.sh <out> <rounds> <scenarios> <modes> NAME=lib.so ...}"
ROUNDS="${2:?rounds}"
SCENARIOS="${3:?scenarios}"
MODES="${4:?modes}"
shift 4
[ "$#" -ge 1 ] || { echo "ab.sh: name at least one build (NAME=lib.so)" >&2; exit 2; }
case ",$MODES," in *,alone,*) ;; *) echo "ab.sh: the modes need alone (every percentage's reference)" >&2; exit 2 ;; esac
RUN_OPTS="${RUN_OPTS:---seconds 4 --no-overlap}"
builds=("$@")
n=${#builds[@]}
mkdir -p "$OUT"
# The host: single windows of launch-bound tenants depend on it (docs/benchmarks.md).
{ nproc; lscpu; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } \
  >"$OUT/host.txt" 2>&1 || true
for r in $(seq 1 "$ROUNDS"); do
  for k in $(seq 0 $((n - 1))); do
    spec="${builds[$(((k + r - 1) % n))]}"
    name="${spec%%=*}"; rest="${spec#*=}"
    lib="${rest%%@*}"; envs=""
    [ "$rest" != "$lib" ] && envs="${rest#*@}"
    # shellcheck disable=SC2086
    env ${envs//,/ } python3 -u "$HERE/run.py" --vgpu-lib "$lib" --rounds 1 $RUN_OPTS \
      --scenarios "$SCENARIOS" --modes "$MODES" --out "$OUT/$name/r$r" >"$OUT/$name-r$r.log" 2>&1 \
      || echo "ab.sh: $name round $r failed (see $OUT/$name-r$r.log)" >&2
  done
done
python3 "$HERE/ab_summary.py" "$OUT" | tee "$OUT/ab.md"
