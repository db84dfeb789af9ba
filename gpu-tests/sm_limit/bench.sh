#!/usr/bin/env bash
# SM-limit accuracy benchmark on a real GPU.
#
#   bash gpu-tests/sm_limit/bench.sh <dir-with-libvgpu.so> [seconds]
#
# Builds spin.cu with nvcc, then runs, each under LD_PRELOAD=<dir>/libvgpu.so with a fresh
# shared file: the spin kernel loop with ~50 µs and ~5 ms kernels, the same loop through a
# CUDA graph, and a PyTorch bf16 matmul loop, unlimited and with CUDA_DEVICE_SM_LIMIT
# 10/25/50/75; then two "containers" (two shared files) at 30 and 70 running together, and
# two processes sharing one file at 50. Prints a table of achieved throughput as a
# percentage of the unlimited run and writes it (and the raw log) under $OUT (or ./out).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
LIBDIR="$(cd "${1:?usage: bench.sh <dir-with-libvgpu.so> [seconds]}" && pwd)"
SECS="${2:-2.5}"
LIB="$LIBDIR/libvgpu.so"
OUTDIR="${OUT:-$PWD/out}"
mkdir -p "$OUTDIR"
WORK="$(mktemp -d)"
LOG="$OUTDIR/sm_limit_raw.log"
TABLE="$OUTDIR/sm_limit_table.txt"
: >"$LOG"
[ -f "$LIB" ] || { echo "no $LIB" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a "$LOG"
nvcc -O3 -arch=sm_90 -o "$WORK/spin" "$HERE/spin.cu" 2>&1 | tee -a "$LOG" || exit 2
[ -x "$WORK/spin" ] || { echo "nvcc failed" >&2; exit 2; }

run_id=0
# run <limit|-> <cache-file-or-empty> <cmd...>: prints the RESULT line.
run() {
  local limit="$1"; shift
  run_id=$((run_id + 1))
  local cache="$WORK/c$run_id.cache"
  rm -f "$cache"
  local envs=(LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cache")
  [ "$limit" != "-" ] && envs+=(CUDA_DEVICE_SM_LIMIT="$limit")
  echo "+ limit=$limit $*" >>"$LOG"
  timeout 90 env "${envs[@]}" "$@" >"$WORK/o$run_id" 2>&1
  local rc=$?
  cat "$WORK/o$run_id" >>"$LOG"
  [ $rc -eq 0 ] || echo "  (exit $rc)" >>"$LOG"
  grep -m1 '^RESULT' "$WORK/o$run_id" || echo "RESULT failed=1"
}
field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; }

# Sanity: the hook loads, sees the limit and reports what it measures (log level 4).
echo "+ sanity" >>"$LOG"
timeout 60 env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/sanity.cache" CUDA_DEVICE_SM_LIMIT=50 \
  LIBCUDA_LOG_LEVEL=4 "$WORK/spin" 1000 1 plain 2>&1 | grep -v "cuMem\|alloc" | tail -20 >>"$LOG"

printf '%-28s %6s %14s %10s %8s\n' workload limit per_second '%unlim' error | tee "$TABLE"
row() { # name limit value base
  local pct err
  if [ -z "$3" ] || [ -z "$4" ]; then
    printf '%-28s %6s %14s %10s %8s\n' "$1" "$2" "${3:-FAIL}" "-" "-" | tee -a "$TABLE"; return
  fi
  pct=$(python3 -c "print(f'{100*$3/$4:.1f}')")
  if [ "$2" = "-" ]; then err="-"; else err=$(python3 -c "print(f'{100*$3/$4-$2:+.1f}')"); fi
  printf '%-28s %6s %14s %10s %8s\n' "$1" "$2" "$3" "$pct" "$err" | tee -a "$TABLE"
}

declare -A ITERS BASE
for kus in 50 5000; do
  for mode in plain graph; do
    [ "$mode" = graph ] && [ "$kus" = 5000 ] && continue
    name="spin ${kus}us $mode"
    bare=$(timeout 90 "$WORK/spin" "$kus" "$SECS" "$mode" 2>>"$LOG")
    echo "+ bare $bare" >>"$LOG"
    iters=$(echo "$bare" | field iters)
    res=$(run - "$WORK/spin" "$kus" "$SECS" "$mode" "$iters")
    base=$(echo "$res" | field kernels_per_s)
    ITERS[$kus]=$iters; BASE[$kus$mode]=$base
    row "$name (no preload)" - "$(echo "$bare" | field kernels_per_s)" "$base"
    row "$name kernel=$(echo "$res" | field kernel_us)us" - "$base" "$base"
    limits="10 25 50 75"; [ "$mode" = graph ] && limits="25 50"
    for l in $limits; do
      res=$(run "$l" "$WORK/spin" "$kus" "$SECS" "$mode" "$iters")
      row "$name" "$l" "$(echo "$res" | field kernels_per_s)" "$base"
    done
  done
done

res=$(run - python3 "$HERE/matmul.py" 4096 "$SECS")
mbase=$(echo "$res" | field matmuls_per_s)
row "torch matmul 4096 bf16 $(echo "$res" | field ms_per_matmul)ms" - "$mbase" "$mbase"
for l in 10 25 50 75; do
  res=$(run "$l" python3 "$HERE/matmul.py" 4096 "$SECS")
  row "torch matmul 4096 bf16" "$l" "$(echo "$res" | field matmuls_per_s)" "$mbase"
done

# Two containers (two files) at 30 and 70, and two processes sharing one file at 50,
# each running the 50 µs loop over the same window; compared with the solo unlimited run.
pair() { # label limitA limitB shared(0|1)
  local ca="$WORK/pa$RANDOM.cache" cb start
  cb="$ca"; [ "$4" = 0 ] && cb="$WORK/pb$RANDOM.cache"
  rm -f "$ca" "$cb"
  start=$(python3 -c 'import time; print(time.time() + 2.0)')
  echo "+ pair $1" >>"$LOG"
  SPIN_START_AT=$start LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$ca" CUDA_DEVICE_SM_LIMIT="$2" \
    timeout 90 "$WORK/spin" 50 "$SECS" plain "${ITERS[50]}" >"$WORK/pa" 2>&1 &
  local pa=$!
  SPIN_START_AT=$start LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cb" CUDA_DEVICE_SM_LIMIT="$3" \
    timeout 90 "$WORK/spin" 50 "$SECS" plain "${ITERS[50]}" >"$WORK/pb" 2>&1 &
  local pb=$!
  wait "$pa" "$pb"
  cat "$WORK/pa" "$WORK/pb" >>"$LOG"
  local a b
  a=$(grep -m1 RESULT "$WORK/pa" | field kernels_per_s)
  b=$(grep -m1 RESULT "$WORK/pb" | field kernels_per_s)
  row "$1 A" "$2" "$a" "${BASE[50plain]}"
  row "$1 B" "$3" "$b" "${BASE[50plain]}"
  if [ -n "$a" ] && [ -n "$b" ] && [ "$4" = 1 ]; then
    row "$1 A+B" "$2" "$(python3 -c "print($a+$b)")" "${BASE[50plain]}"
  fi
}
pair "2 containers 30/70 spin 50us" 30 70 0
pair "1 container 2 procs spin 50us" 50 50 1

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')" | tee -a "$TABLE"
rm -rf "$WORK"
