#!/usr/bin/env bash
# The hook's own cost on a launch-bound request (launch_bound.cu), bare and under each hook mode,
# three rounds of 3 s per process, plus the driver calls' own costs on this GPU.
#
#   bash gpu-tests/sm_limit/launch_bound.sh path/to/libvgpu.so
set -u
lib="$(realpath "${1:?usage: launch_bound.sh path/to/libvgpu.so}")"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d /tmp/vgpu-launch-bound.XXXXXX)"
trap 'rm -rf "$work"' EXIT
nvcc -O2 -o "$work/lb" "$here/launch_bound.cu" -lcuda || exit 1
"$work/lb" 3 --driver-costs
hooked() { env LD_PRELOAD="$lib" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/c$RANDOM" LIBCUDA_LOG_LEVEL=3 "$@" "$work/lb" 3 2>&1 | grep -E "limiter stats|requests=" | sed 's/.*limiter stats: /stats: /' | tr '\n' ' '; echo; }
for i in 1 2 3; do
    mkdir -p "$work/t$i"
    echo "bare: $("$work/lb" 3)"
    echo "hooked, no limit: $(hooked)"
    echo "hooked, share p0: $(hooked VGPU_SM_MODE=share CUDA_TASK_PRIORITY=0 VGPU_TURN_DIR="$work/t$i")"
    echo "hooked, cap 90: $(hooked CUDA_DEVICE_SM_LIMIT=90)"
done
