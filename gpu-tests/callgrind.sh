#!/usr/bin/env bash
# Instructions per call of the hooked alloc, free and launch paths (callgrind, on the simulated
# driver; no GPU needed). Each program runs bare and under libvgpu.so with two operation counts;
# the per-call cost is the difference of the entry point's inclusive instruction count between
# the two runs divided by the difference in calls, so start-up and lazy initialisation cancel.
#
#   bash gpu-tests/callgrind.sh        (builds release libvgpu.so and libvgpusim.so with cargo)
#
# The hooked entry point's inclusive count contains the simulated driver's work for the calls
# the hook forwards or makes itself; that part (every libvgpusim.so entry point's inclusive
# count, differenced the same way) is shown and subtracted to give the hook's own instructions.
# Prints a markdown table (the one in docs/benchmarks.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    (cd "$root" && cargo build --release -q -p vgpu-hook -p vgpu-sim)
fi
hook="$target/release/libvgpu.so"
sim="$target/release/libvgpusim.so"
work="$(mktemp -d /tmp/vgpu-callgrind.XXXXXX)"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lib"
for n in libcuda.so libcuda.so.1 libnvidia-ml.so libnvidia-ml.so.1; do ln -s "$sim" "$work/lib/$n"; done
progs="$root/crates/vgpu-hook/tests/programs"
cc -O2 -o "$work/probe" "$progs/probe.c" -I "$progs" -L "$work/lib" -lcuda -ldl -lpthread

# inclusive Ir of exported function $2 of object $3 (libvgpu.so / libvgpusim.so) in profile $1
incl() {
    # From a neutral directory: callgrind_annotate groups costs differently when it can open
    # the sources through relative paths. The function's own line is its largest one.
    (cd /tmp && callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
        awk -v fn="$2" -v obj="$3" '{
            if (index($0, ":" fn " [") && index($0, obj "]")) { gsub(",", "", $1); if ($1 + 0 > max) max = $1 + 0 }
        } END { print max + 0 }')
}

# sum of the inclusive Ir of every exported driver entry point of libvgpusim.so in profile $1
# (the simulated driver's own work, wherever it was called from). An entry point's name
# follows the file's single colon: the simulator's inner methods (`Sim>::cur_dev`,
# `::current`) also begin with "cu" but follow "::", and are inside the entry points.
simsum() {
    (cd /tmp && callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
        awk '/libvgpusim\.so\]/ && match($0, /[^:]:(cu|nvml)[A-Za-z0-9_]+ \[/) {
            name = substr($0, RSTART + 2, RLENGTH - 4); v = $1; gsub(",", "", v)
            if (v + 0 > max[name]) max[name] = v + 0
        } END { for (n in max) t += max[n]; print t + 0 }')
}

# run MODE(bare|hooked) N ARGS... -> profile path
run() {
    local mode="$1" n="$2"; shift 2
    local out="$work/$mode.$n.$1${EXTRA_ENV:+.x}.out"
    local env=(LD_LIBRARY_PATH="$work/lib" VGPU_SIM_TOTAL_MEM=141g ${EXTRA_ENV:-})
    if [ "$mode" = hooked ]; then
        env+=(LD_PRELOAD="$hook" CUDA_DEVICE_MEMORY_LIMIT=100g CUDA_DEVICE_MEMORY_SHARED_CACHE="$out.cache")
    fi
    env "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$out" "$work/probe" "$@" >/dev/null 2>"$out.log"
    echo "$out"
}

# row LABEL "FN[+FN]" N1 N2 CMD ARGS-after-N...: per operation (one call of each FN)
row() {
    local label="$1" fns="$2" n1="$3" n2="$4" cmd="$5"; shift 5
    local pb1 pb2 ph1 ph2 b=0 h=0 s1 s2 f
    pb1=$(run bare "$n1" "$cmd" "$n1" "$@"); pb2=$(run bare "$n2" "$cmd" "$n2" "$@")
    ph1=$(run hooked "$n1" "$cmd" "$n1" "$@"); ph2=$(run hooked "$n2" "$cmd" "$n2" "$@")
    for f in ${fns//+/ }; do
        b=$((b + $(incl "$pb2" "$f" libvgpusim.so) - $(incl "$pb1" "$f" libvgpusim.so)))
        h=$((h + $(incl "$ph2" "$f" libvgpu.so) - $(incl "$ph1" "$f" libvgpu.so)))
    done
    s1=$(simsum "$ph1"); s2=$(simsum "$ph2")
    awk -v l="$label" -v b="$b" -v h="$h" -v s="$((s2 - s1))" -v n="$((n2 - n1))" 'BEGIN {
        printf "| %s | %.0f | %.0f | %.0f | %.0f |\n", l, b / n, h / n, s / n, (h - s) / n }'
}

echo "| operation (per call) | bare: simulated driver | hooked: libvgpu.so entry point | of which simulated-driver calls | the hook's own instructions |"
echo "|---|---|---|---|---|"
row "cuMemAlloc_v2 + cuMemFree_v2, 4 MiB (direct)" "cuMemAlloc_v2+cuMemFree_v2" 1000 3000 bench_alloc $((4 << 20))
row "cuMemAlloc_v2 + cuMemFree_v2, 1 KiB (sub-allocated, 5,000-15,000 live)" "cuMemAlloc_v2+cuMemFree_v2" 5000 15000 bench_small 1024
row "cuLaunchKernel, no SM limit" cuLaunchKernel 2000 6000 bench_launch
EXTRA_ENV=CUDA_DEVICE_SM_LIMIT=50 row "cuLaunchKernel, CUDA_DEVICE_SM_LIMIT=50" cuLaunchKernel 2000 6000 bench_launch
