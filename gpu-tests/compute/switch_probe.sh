#!/usr/bin/env bash
# What a context switch costs, by how it happens: switch_probe.cu's modes, each pair against
# one process alone, for a registers-only kernel and one that re-reads an L2-sized buffer.
# One JSON line per process in <out>/switch.jsonl, a summary from switch_probe.py.
#
#   bash gpu-tests/compute/switch_probe.sh <out-dir> [seconds per run, default 3]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:?usage: switch_probe.sh <out-dir> [seconds]}"
SECS="${2:-3}"
mkdir -p "$OUT"
BIN="$OUT/switch_probe"
nvcc -O2 -o "$BIN" "$HERE/switch_probe.cu" -lcuda
J="$OUT/switch.jsonl"
: >"$J"
one() {  # label, args of one process
  local label="$1"; shift
  "$BIN" --seconds "$SECS" "$@" | sed "s#^{#{\"label\":\"$label\",#" >>"$J"
}
two() {  # label, args of role 0 | args of role 1 (separated by --)
  local label="$1"; shift
  local a=() b=() side=a
  for x in "$@"; do
    if [ "$x" = "--" ]; then side=b; continue; fi
    if [ $side = a ]; then a+=("$x"); else b+=("$x"); fi
  done
  local flag; flag="$(mktemp /dev/shm/swprobe.XXXXXX)"
  "$BIN" --seconds "$SECS" --flag "$flag" --role 0 "${a[@]}" | sed "s#^{#{\"label\":\"$label\",#" >>"$J" &
  "$BIN" --seconds "$SECS" --flag "$flag" --role 1 "${b[@]}" | sed "s#^{#{\"label\":\"$label\",#" >>"$J"
  wait
  rm -f "$flag"
}
for k in spin l2; do
  one "$k alone deep" --mode deep --kernel $k
  one "$k alone turn-solo 4ms" --mode turn-solo --kernel $k --turn-ms 4
  two "$k deep+deep" --mode deep --kernel $k -- --mode deep --kernel $k
  two "$k deep+burst 2/6.67" --mode deep --kernel $k -- --mode burst --kernel $k --burst-ms 2 --period-ms 6.67
  two "$k deep+burst 6/20" --mode deep --kernel $k -- --mode burst --kernel $k --burst-ms 6 --period-ms 20
  two "$k turn 4ms" --mode turn --kernel $k --turn-ms 4 -- --mode turn --kernel $k --turn-ms 4
  two "$k turn 1ms" --mode turn --kernel $k --turn-ms 1 -- --mode turn --kernel $k --turn-ms 1
  two "$k handoff 4ms lead 0.3" --mode handoff --kernel $k --turn-ms 4 -- --mode handoff --kernel $k --turn-ms 4
  two "$k handoff 1ms lead 0.3" --mode handoff --kernel $k --turn-ms 1 -- --mode handoff --kernel $k --turn-ms 1
done
python3 "$HERE/switch_probe.py" "$J" | tee "$OUT/switch.md"
