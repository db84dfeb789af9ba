#!/usr/bin/env bash
# What a sample measures beside a neighbour (sample_probe.cu): the prober alone, beside a deep
# neighbour and beside a launch-bound one, for a 5 µs and a 50 µs kernel. JSON lines in
# <out>/sample.jsonl.
#
#   bash gpu-tests/compute/sample_probe.sh <out-dir> [trials, default 300]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:?usage: sample_probe.sh <out-dir> [trials]}"
TRIALS="${2:-300}"
mkdir -p "$OUT"
BIN="$OUT/sample_probe"
nvcc -O2 -o "$BIN" "$HERE/sample_probe.cu" -lcuda
J="$OUT/sample.jsonl"
: >"$J"
for us in 5 50; do
  "$BIN" --role prober --label alone --kernel-us "$us" --trials "$TRIALS" >>"$J"
  for kind in deep launchbound; do
    "$BIN" --role neighbour --kind "$kind" --seconds 60 >/dev/null &
    nb=$!
    sleep 1
    "$BIN" --role prober --label "$kind" --kernel-us "$us" --trials "$TRIALS" >>"$J"
    kill "$nb" 2>/dev/null || true
    wait "$nb" 2>/dev/null || true
  done
done
python3 - "$J" <<'PY' | tee "$OUT/sample.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"prober"' in l]
print("| kernel µs | neighbour | mode | p10 | p50 | p90 | p99 | max | start done after call |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['kernel_us']:.0f} | {r['label']} | {r['mode']} | {r['p10']:.1f} | {r['p50']:.1f} | "
          f"{r['p90']:.1f} | {r['p99']:.1f} | {r['max']:.1f} | {r['start_done_after_call']:.2f} |")
PY
