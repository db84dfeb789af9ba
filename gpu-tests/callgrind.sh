#!/usr/bin/env bash
# Instructions per call of the hooked alloc, free and launch paths (callgrind, on the simulated
# driver; no GPU needed). Each program runs bare and under libvgpu.so with two operation counts;
# the per-call cost is the difference of the entry point's inclusive instruction count between
# the two runs divided by the difference in calls, so start-up and lazy initialisation cancel.
#
#   bash gpu-tests/callgrind.sh        (builds release libvgpu.so and libvgpusim.so with cargo)
#
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

# run MODE(bare|hooked) N ARGS... -> profile path
run() {
    local mode="$1" n="$2"; shift 2
    local out="$work/$mode.$n.$1.out"
    local env=(LD_LIBRARY_PATH="$work/lib" VGPU_SIM_TOTAL_MEM=141g ${EXTRA_ENV:-})
    if [ "$mode" = hooked ]; then
        env+=(LD_PRELOAD="$hook" CUDA_DEVICE_MEMORY_LIMIT=100g CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/$mode.$n.$1.cache")
    fi
    env "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$out" "$work/probe" "$@" >/dev/null 2>"$out.log"
    echo "$out"
}

# row LABEL FN N1 N2 CMD ARGS-after-N...
row() {
    local label="$1" fn="$2" n1="$3" n2="$4" cmd="$5"; shift 5
    local b1 b2 h1 h2
    b1=$(incl "$(run bare "$n1" "$cmd" "$n1" "$@")" "$fn" libvgpusim.so)
    b2=$(incl "$(run bare "$n2" "$cmd" "$n2" "$@")" "$fn" libvgpusim.so)
    h1=$(incl "$(run hooked "$n1" "$cmd" "$n1" "$@")" "$fn" libvgpu.so)
    h2=$(incl "$(run hooked "$n2" "$cmd" "$n2" "$@")" "$fn" libvgpu.so)
    awk -v l="$label" -v b1="$b1" -v b2="$b2" -v h1="$h1" -v h2="$h2" -v n="$((n2 - n1))" 'BEGIN {
        b = (b2 - b1) / n; h = (h2 - h1) / n
        printf "| %s | %.0f | %.0f | %+.0f |\n", l, b, h, h - b }'
}

echo "| path (per call) | bare simulated driver, Ir | under libvgpu.so, Ir | added by the hook, Ir |"
echo "|---|---|---|---|"
row "cuMemAlloc_v2, 4 MiB (direct)" cuMemAlloc_v2 1000 3000 bench_alloc $((4 << 20))
row "cuMemFree_v2, 4 MiB (direct)" cuMemFree_v2 1000 3000 bench_alloc $((4 << 20))
row "cuMemAlloc_v2, 1 KiB (sub-allocated), N live" cuMemAlloc_v2 5000 15000 bench_small 1024
row "cuMemFree_v2, 1 KiB (sub-allocated), N live" cuMemFree_v2 5000 15000 bench_small 1024
row "cuLaunchKernel, no SM limit" cuLaunchKernel 2000 6000 bench_launch
EXTRA_ENV=CUDA_DEVICE_SM_LIMIT=50 row "cuLaunchKernel, CUDA_DEVICE_SM_LIMIT=50" cuLaunchKernel 2000 6000 bench_launch
