#!/usr/bin/env bash
# SM-limit accuracy benchmark on a real GPU.
#
#   bash gpu-tests/sm_limit/bench.sh <dir-with-libvgpu.so> [seconds]
#
# Builds spin.cu with nvcc, then runs, each under LD_PRELOAD=<dir>/libvgpu.so with a fresh
# shared file: the spin kernel loop with ~50 µs, ~500 µs and ~5 ms kernels, the 50 µs loop
# through a CUDA graph, and PyTorch bf16 matmul loops, unlimited and with
# CUDA_DEVICE_SM_LIMIT 10/25/50/75 (cap mode, each alone on the GPU); then two "containers"
# (two shared files on one board directory) at 30 and 70 running together, and two
# processes sharing one file at 50. Prints a table of achieved throughput as a percentage of
# the unlimited run and writes it (and the raw log) under $OUT (or ./out).
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
# median of the numbers on stdin (empty if none)
median() { python3 -c 'import sys,statistics as s; v=[float(x) for x in sys.stdin.read().split()]; print(f"{s.median(v):.0f}" if v else "")'; }
# run <limit|-> <cmd...>: prints the RESULT line, extended with what the limiter measured
# (busy=, median of its published utilization over the second half of the run) and the
# GPU's median SM clock and power draw over the second half (mhz=, watts=).
run() {
  local limit="$1"; shift
  run_id=$((run_id + 1))
  local cache="$WORK/c$run_id.cache" smi="$WORK/smi$run_id"
  rm -f "$cache"
  local envs=(LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cache" LIBCUDA_LOG_LEVEL=4)
  [ "$limit" != "-" ] && envs+=(CUDA_DEVICE_SM_LIMIT="$limit")
  echo "+ limit=$limit $*" >>"$LOG"
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 250 >"$smi" 2>/dev/null &
  local sampler=$!
  timeout 90 env "${envs[@]}" "$@" >"$WORK/o$run_id" 2>"$WORK/e$run_id"
  local rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  grep -v DEBUG "$WORK/e$run_id" | tail -5 >>"$LOG"
  cat "$WORK/o$run_id" >>"$LOG"
  [ $rc -eq 0 ] || echo "  (exit $rc)" >>"$LOG"
  local util half busy mhz watts n
  util=$(sed -n 's/.*achieved SM utilization \([0-9]*\)%.*/\1/p' "$WORK/e$run_id")
  n=$(echo "$util" | wc -w); half=$(( (n + 1) / 2 ))
  busy=$(echo "$util" | tail -n "$half" | median)
  n=$(wc -l <"$smi"); half=$(( (n + 1) / 2 ))
  mhz=$(tail -n "$half" "$smi" | cut -d, -f1 | median)
  watts=$(tail -n "$half" "$smi" | cut -d, -f2 | median)
  local res
  res=$(grep -m1 '^RESULT' "$WORK/o$run_id" || echo "RESULT failed=1")
  echo "$res busy=${busy:-} mhz=${mhz:-} watts=${watts:-}"
  echo "  limiter busy=${busy:-?}% sm=${mhz:-?}MHz power=${watts:-?}W" >>"$LOG"
}
field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; }

# Sanity: the hook loads, sees the limit and reports what it measures (log level 4).
# The table's busy% column is the limiter's own measurement (events), SM_MHz and W the GPU's
# median clock and power over the second half of the run: a throughput ratio above the
# limit with busy% on target means the GPU ran faster per busy second (clocks).
echo "+ sanity" >>"$LOG"
timeout 60 env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/sanity.cache" CUDA_DEVICE_SM_LIMIT=50 \
  LIBCUDA_LOG_LEVEL=4 "$WORK/spin" 1000 1 plain 2>&1 | grep -v "cuMem\|alloc" | tail -20 >>"$LOG"

printf '%-34s %6s %12s %8s %7s %6s %6s %5s\n' workload limit per_second '%unlim' error busy% SM_MHz W | tee "$TABLE"
row() { # name limit value base [result-line for busy/mhz/watts]
  local pct err busy mhz watts
  busy=$(echo "${5:-}" | field busy); mhz=$(echo "${5:-}" | field mhz); watts=$(echo "${5:-}" | field watts)
  if [ -z "$3" ] || [ -z "$4" ]; then
    printf '%-34s %6s %12s %8s %7s\n' "$1" "$2" "${3:-FAIL}" "-" "-" | tee -a "$TABLE"; return
  fi
  pct=$(python3 -c "print(f'{100*$3/$4:.1f}')")
  if [ "$2" = "-" ]; then err="-"; else err=$(python3 -c "print(f'{100*$3/$4-$2:+.1f}')"); fi
  printf '%-34s %6s %12s %8s %7s %6s %6s %5s\n' "$1" "$2" "$3" "$pct" "$err" "${busy:--}" "${mhz:--}" "${watts:--}" | tee -a "$TABLE"
}

declare -A ITERS BASE
for kus in 50 500 5000; do
  for mode in plain graph; do
    [ "$mode" = graph ] && [ "$kus" != 50 ] && continue
    name="spin ${kus}us $mode"
    bare=$(timeout 90 "$WORK/spin" "$kus" "$SECS" "$mode" 2>>"$LOG")
    echo "+ bare $bare" >>"$LOG"
    iters=$(echo "$bare" | field iters)
    res=$(run - "$WORK/spin" "$kus" "$SECS" "$mode" "$iters")
    base=$(echo "$res" | field kernels_per_s)
    ITERS[$kus]=$iters; BASE[$kus$mode]=$base
    row "$name (no preload)" - "$(echo "$bare" | field kernels_per_s)" "$base"
    row "$name kernel=$(echo "$res" | field kernel_us)us" - "$base" "$base" "$res"
    limits="${SM_BENCH_LIMITS-10 25 50 75}"; [ "$mode" = graph ] && limits="${SM_BENCH_LIMITS-25 50}"
    for l in $limits; do
      res=$(run "$l" "$WORK/spin" "$kus" "$SECS" "$mode" "$iters")
      row "$name" "$l" "$(echo "$res" | field kernels_per_s)" "$base" "$res"
    done
  done
done

# PyTorch: 4096³ (~0.3 ms per product) and 8192³ (~1.4 ms, certainly GPU-bound) bf16. Each
# loop warms up (SM_BENCH_MATMUL_WARMUP, default 3 s) before it is timed, unlimited runs
# alike, so that the timed window starts with the launches' costs learned and the GPU at
# the clock it holds under sustained matmuls (which runs them power-capped when unlimited).
export MATMUL_WARMUP_S="${SM_BENCH_MATMUL_WARMUP:-3}"
declare -A MBASE
for size in ${SM_BENCH_TORCH_SIZES-4096 8192}; do
  res=$(run - python3 "$HERE/matmul.py" "$size" "$SECS")
  mbase=$(echo "$res" | field matmuls_per_s)
  MBASE[$size]=$mbase
  row "torch matmul $size bf16 $(echo "$res" | field ms_per_matmul)ms" - "$mbase" "$mbase" "$res"
  for l in ${SM_BENCH_TORCH_LIMITS:-10 25 50 75}; do
    res=$(run "$l" python3 "$HERE/matmul.py" "$size" "$SECS")
    row "torch matmul $size" "$l" "$(echo "$res" | field matmuls_per_s)" "$mbase" "$res"
  done
done

# Two containers running the 4096 matmul at 30 and 70 on one board directory.
torch_pair() { # label limitA limitB
  [ -n "${MBASE[4096]:-}" ] || return 0
  local ca="$WORK/ta$RANDOM.cache" cb="$WORK/tb$RANDOM.cache" board="$WORK/tboard$RANDOM" start
  mkdir -p "$board"
  start=$(python3 -c 'import time; print(time.time() + 12.0)')
  echo "+ torch pair $1" >>"$LOG"
  local common=(LD_PRELOAD="$LIB" LIBCUDA_LOG_LEVEL=4 MATMUL_START_AT="$start" VGPU_TURN_DIR="$board")
  env "${common[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE="$ca" CUDA_DEVICE_SM_LIMIT="$2" \
    timeout 90 python3 "$HERE/matmul.py" 4096 "$SECS" >"$WORK/ta" 2>"$WORK/tae" &
  local pa=$!
  env "${common[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cb" CUDA_DEVICE_SM_LIMIT="$3" \
    timeout 90 python3 "$HERE/matmul.py" 4096 "$SECS" >"$WORK/tb" 2>"$WORK/tbe" &
  local pb=$!
  wait "$pa" "$pb"
  cat "$WORK/ta" "$WORK/tb" >>"$LOG"
  for e in tae tbe; do grep -E "achieved|limiter stats" "$WORK/$e" | tail -4 >>"$LOG"; done
  row "$1 A" "$2" "$(grep -m1 RESULT "$WORK/ta" | field matmuls_per_s)" "${MBASE[4096]}"
  row "$1 B" "$3" "$(grep -m1 RESULT "$WORK/tb" | field matmuls_per_s)" "${MBASE[4096]}"
}
for round in $(seq "${SM_BENCH_TORCH_PAIR_ROUNDS:-1}"); do
  torch_pair "2 containers matmul 30/70" 30 70
done

# Two containers (two files, one board directory) at 30 and 70 or 50 and 50, and two
# processes sharing one file at 50, each running the spin loop over the same window;
# compared with the solo unlimited run.
pair() { # label limitA limitB shared(0|1) [kernel-us]
  local ca="$WORK/pa$RANDOM.cache" cb start kus="${5:-50}" board="$WORK/board$RANDOM"
  mkdir -p "$board"
  cb="$ca"; [ "$4" = 0 ] && cb="$WORK/pb$RANDOM.cache"
  rm -f "$ca" "$cb"
  start=$(python3 -c 'import time; print(time.time() + 2.0)')
  echo "+ pair $1" >>"$LOG"
  local common=(LD_PRELOAD="$LIB" LIBCUDA_LOG_LEVEL=4 SPIN_START_AT="$start" VGPU_TURN_DIR="$board")
  env "${common[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE="$ca" CUDA_DEVICE_SM_LIMIT="$2" \
    timeout 90 "$WORK/spin" "$kus" "$SECS" plain "${ITERS[$kus]}" >"$WORK/pa" 2>"$WORK/pae" &
  local pa=$!
  env "${common[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cb" CUDA_DEVICE_SM_LIMIT="$3" \
    timeout 90 "$WORK/spin" "$kus" "$SECS" plain "${ITERS[$kus]}" >"$WORK/pb" 2>"$WORK/pbe" &
  local pb=$!
  wait "$pa" "$pb"
  cat "$WORK/pa" "$WORK/pb" >>"$LOG"
  for e in pae pbe; do grep -E "achieved|limiter stats" "$WORK/$e" | tail -6 >>"$LOG"; done
  local a b
  a=$(grep -m1 RESULT "$WORK/pa" | field kernels_per_s)
  b=$(grep -m1 RESULT "$WORK/pb" | field kernels_per_s)
  row "$1 A" "$2" "$a" "${BASE[${kus}plain]}"
  row "$1 B" "$3" "$b" "${BASE[${kus}plain]}"
  if [ -n "$a" ] && [ -n "$b" ] && [ "$4" = 1 ]; then
    row "$1 A+B" "$2" "$(python3 -c "print($a+$b)")" "${BASE[${kus}plain]}"
  fi
  echo "  board: $(ls "$board")" >>"$LOG"
}
for round in $(seq "${SM_BENCH_PAIR_ROUNDS:-1}"); do
  pair "2 containers 30/70" 30 70 0
  pair "2 containers 30/70 500us" 30 70 0 500
  pair "2 containers 30/70 5ms" 30 70 0 5000
  pair "2 containers 50/50" 50 50 0
  pair "1 container 2 procs spin 50us" 50 50 1
done

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')" | tee -a "$TABLE"
rm -rf "$WORK"
