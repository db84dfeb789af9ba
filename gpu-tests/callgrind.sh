#!/usr/bin/env bash
# Instructions per call of the hooked alloc, free and launch paths (callgrind, on the simulated
# driver; no GPU needed). Each program runs bare and under libvgpu.so with two operation counts;
# the per-call cost is the difference of the entry point's inclusive instruction count between
# the two runs divided by the difference in calls, so start-up and lazy initialisation cancel.
#
#   bash gpu-tests/callgrind.sh        (builds release libvgpu.so and libvgpusim.so with cargo)
#
# The hooked entry point's inclusive count contains the simulated driver's work for the calls
# the hook forwards or makes itself; that part (the driver entry points called from within the
# measured hooked calls, differenced the same way) is shown and subtracted to give the hook's
# own instructions.
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

# Profiles are taken with --separate-callers, so every function's cost is split by its call
# chain: the simulated driver's work is counted only where it ran inside the measured hooked
# calls (summing every driver entry point would also count the program's final
# cuStreamSynchronize, which varies with wall time). Chains are cut at CHAIN_DEPTH callers.
chain_depth="${CHAIN_DEPTH:-40}"

# inclusive Ir in profile $1 of: mode=bare|hook, the exported functions $2 (space list) of
# libvgpusim.so / libvgpu.so as the program called them; mode=sim, the simulated driver's
# entry points called by the hook from within those hooked functions.
cost() {
    # From a neutral directory: callgrind_annotate groups costs differently when it can open
    # the sources through relative paths.
    (cd /tmp && callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
        awk -v mode="$3" -v fns="$2" '
        BEGIN { k = split(fns, f, " "); for (i = 1; i <= k; i++) want[f[i]] = 1 }
        {
            if (!match($0, / \[[^]]*\]$/)) next
            obj = substr($0, RSTART + 2, RLENGTH - 3)
            c = $1; gsub(",", "", c)
            line = substr($0, 1, RSTART - 1)
            sub(/^ *[0-9,]+ \([ 0-9.]+%\) +/, "", line)
            sub(/^[^:\x27]*:/, "", line)
            # chain[1] is the function, chain[2] its caller, and so on.
            n = split(line, chain, "\x27")
            if (mode == "bare" || mode == "hook") {
                lib = mode == "bare" ? "libvgpusim[.]so$" : "libvgpu[.]so$"
                # Called by the program, not from inside a library.
                if (obj ~ lib && chain[1] in want && !(n >= 2 && chain[2] ~ /^vgpu/)) t += c
            } else if (obj ~ /libvgpusim[.]so$/ && chain[1] ~ /^(cu|nvml)[A-Za-z0-9_]*$/ &&
                       n >= 2 && chain[2] !~ /^vgpusim/) {
                # An entry point the hook called, below one of the measured hooked calls.
                for (i = 2; i <= n; i++) if (chain[i] in want) { t += c; break }
            }
        }
        END { print t + 0 }')
}

# run MODE(bare|hooked) N ARGS... -> profile path
run() {
    local mode="$1" n="$2"; shift 2
    local out="$work/$mode.$n.$1${EXTRA_ENV:+.x}.out"
    local env=(LD_LIBRARY_PATH="$work/lib" VGPU_SIM_TOTAL_MEM=141g ${EXTRA_ENV:-})
    if [ "$mode" = hooked ]; then
        # A board directory of its own (as HAMi's device plugin mounts one into every
        # container), never the machine's /tmp/vgpulock, whose contents other runs leave.
        mkdir -p "$out.board"
        env+=(LD_PRELOAD="$hook" CUDA_DEVICE_MEMORY_LIMIT=100g CUDA_DEVICE_MEMORY_SHARED_CACHE="$out.cache"
              VGPU_TURN_DIR="$out.board")
    fi
    env "${env[@]}" valgrind --tool=callgrind --separate-callers="$chain_depth" --callgrind-out-file="$out" "$work/probe" "$@" >/dev/null 2>"$out.log"
    echo "$out"
}

# row LABEL "FN[+FN]" N1 N2 CMD ARGS-after-N...: per operation (one call of each FN)
row() {
    local label="$1" fns="$2" n1="$3" n2="$4" cmd="$5"; shift 5
    local pb1 pb2 ph1 ph2 b h s1 s2
    pb1=$(run bare "$n1" "$cmd" "$n1" "$@"); pb2=$(run bare "$n2" "$cmd" "$n2" "$@")
    ph1=$(run hooked "$n1" "$cmd" "$n1" "$@"); ph2=$(run hooked "$n2" "$cmd" "$n2" "$@")
    fns="${fns//+/ }"
    b=$(($(cost "$pb2" "$fns" bare) - $(cost "$pb1" "$fns" bare)))
    h=$(($(cost "$ph2" "$fns" hook) - $(cost "$ph1" "$fns" hook)))
    s1=$(cost "$ph1" "$fns" sim); s2=$(cost "$ph2" "$fns" sim)
    awk -v l="$label" -v b="$b" -v h="$h" -v s="$((s2 - s1))" -v n="$((n2 - n1))" 'BEGIN {
        printf "| %s | %.0f | %.0f | %.0f | %.0f |\n", l, b / n, h / n, s / n, (h - s) / n }'
}

echo "| operation (per call) | bare: simulated driver | hooked: libvgpu.so entry point | of which simulated-driver calls | the hook's own instructions |"
echo "|---|---|---|---|---|"
row "cuMemAlloc_v2 + cuMemFree_v2, 4 MiB (direct)" "cuMemAlloc_v2+cuMemFree_v2" 1000 3000 bench_alloc $((4 << 20))
row "cuMemAlloc_v2 + cuMemFree_v2, 1 KiB (sub-allocated, 5,000-15,000 live)" "cuMemAlloc_v2+cuMemFree_v2" 5000 15000 bench_small 1024
row "cuLaunchKernel, no SM limit" cuLaunchKernel 2000 6000 bench_launch
EXTRA_ENV=CUDA_DEVICE_SM_LIMIT=50 row "cuLaunchKernel, CUDA_DEVICE_SM_LIMIT=50" cuLaunchKernel 2000 6000 bench_launch
