"""libvgpu.so against the bare driver, in the same run on the same GPU (run by gpu-tests/run.sh).

Each measurement runs the same program bare and under the hook (limit 100g, so accounting is
active; no SM limit), alternating, ROUNDS times, and reports medians and ratios in
$VGPU_OUT/bench.md and bench.json.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

LIB = os.environ["VGPU_LIB"]
PROBE = os.environ["VGPU_PROBE"]
OUT = os.environ.get("VGPU_OUT", tempfile.gettempdir())
JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs.py")
SCRATCH = tempfile.mkdtemp(prefix="vgpu-bench-")
ROUNDS = int(os.environ.get("VGPU_BENCH_ROUNDS", "3"))
# Comma-separated parts of measurement names to run (all when unset), e.g. "direct,launch".
ONLY = [p.strip() for p in os.environ.get("VGPU_BENCH_ONLY", "").split(",") if p.strip()]


def run(args, hooked):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "LD_PRELOAD"))}
    if hooked:
        env["LD_PRELOAD"] = LIB
        env["CUDA_DEVICE_MEMORY_LIMIT"] = "100g"
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = tempfile.mktemp(suffix=".cache", dir=SCRATCH)
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{args} hooked={hooked} failed: {p.stdout}\n{p.stderr[-2000:]}")
    return {k: float(v) for k, v in (l.split("=", 1) for l in p.stdout.splitlines() if "=" in l) if _num(v)}


def _num(v):
    try:
        float(v)
        return True
    except ValueError:
        return False


def measure(args, key, rounds=None):
    bare, hooked = [], []
    for _ in range(rounds or ROUNDS):
        bare.append(run(args, False)[key])
        hooked.append(run(args, True)[key])
    return statistics.median(bare), statistics.median(hooked), bare, hooked


results = {}
rows = []


def add(name, args, key, unit, goal, rounds=None):
    if ONLY and not any(p in name for p in ONLY):
        return None
    try:
        b, h, bs, hs = measure(args, key, rounds)
    except Exception as e:  # noqa: BLE001 - a failed measurement is reported, not hidden
        print(f"{name}: FAILED: {e}", flush=True)
        rows.append(f"| {name} | failed | | | | {goal} |")
        results[name] = {"error": str(e)}
        return None
    results[name] = {"bare": b, "hooked": h, "bare_runs": bs, "hooked_runs": hs, "unit": unit}
    ratio = h / b if b else float("nan")
    rows.append(f"| {name} | {b:.3f} {unit} | {h:.3f} {unit} | {h - b:+.3f} {unit} | {ratio:.3f} | {goal} |")
    print(rows[-1], flush=True)
    return b, h


add("direct cuMemAlloc+cuMemFree pair, 4 MiB", [PROBE, "bench_alloc", "2000", str(4 << 20)], "pair_us", "us",
    "added <= 1 us", rounds=max(7, ROUNDS))
small = add("small cuMemAlloc, 1 KiB (20,000 live)", [PROBE, "bench_small", "20000", "1024"], "alloc_us", "us",
            "hooked >= 20x faster")
add("small cuMemFree, 1 KiB (20,000 live)", [PROBE, "bench_small", "20000", "1024"], "free_us", "us", "")
live1 = add("free with 1 live, 1 KiB", [PROBE, "bench_free_live", "1", "2000", "1024"], "free_us", "us", "")
live20k = add("free with 20,000 live, 1 KiB", [PROBE, "bench_free_live", "20000", "2000", "1024"], "free_us", "us",
              "same as with 1 live")
live1b = add("free with 1 live, 2 MiB", [PROBE, "bench_free_live", "1", "500", str(2 << 20)], "free_us", "us", "")
live20kb = add("free with 20,000 live, 2 MiB", [PROBE, "bench_free_live", "20000", "500", str(2 << 20)], "free_us",
               "us", "same as with 1 live")
add("kernel launch (host side, empty kernel)", [PROBE, "bench_launch", "50000"], "launch_us", "us", "<= 1%")
try:
    import torch  # noqa: F401

    add("PyTorch training step (MLP 4096, batch 1024)", [sys.executable, JOBS, "torch_step_time", "200"],
        "step_ms_median", "ms", "<= 1%")
except ImportError:
    rows.append("| PyTorch training step | skipped: no torch | | | | |")

summary = []
if small:
    summary.append(f"small allocations: hooked is {small[0] / small[1]:.1f}x faster than bare cuMemAlloc")
if live1 and live20k:
    summary.append(f"hooked free, 20,000 live vs 1 (1 KiB): {live20k[1] / live1[1]:.2f}x")
if live1b and live20kb:
    summary.append(f"hooked free, 20,000 live vs 1 (2 MiB): {live20kb[1] / live1b[1]:.2f}x")

md = ["| measurement | bare | hooked | hooked - bare | hooked / bare | goal |", "|---|---|---|---|---|---|", *rows,
      "", *[f"- {s}" for s in summary]]
with open(os.path.join(OUT, "bench.md"), "w") as f:
    f.write("\n".join(md) + "\n")
with open(os.path.join(OUT, "bench.json"), "w") as f:
    json.dump(results, f, indent=1)
print("\n".join(md))
