"""How a power-capped matmul's throughput follows its duty cycle (no hook involved).

usage: python3 duty_probe.py <n> <seconds> [cycles_ms,...] [duties,...]

Runs a bf16 n×n matmul loop unlimited, then duty-cycled by hand: in each cycle of C ms the
loop launches for duty×C ms of wall time (keeping at most a few matmuls queued), waits for
the GPU, and sleeps for the rest. For each (duty, cycle) it prints the throughput as a
percentage of the unlimited loop and the GPU's SM clock and instantaneous power sampled
every ~1 ms by NVML while the GPU was busy ("on") and idle ("off"). It answers: how long
must a busy spell be for the GPU's power controller to run it at the same (capped) clock as
the unlimited loop, so that a share of GPU time is the same share of throughput?
"""
import ctypes
import statistics
import sys
import threading
import time

import torch

n = int(sys.argv[1])
seconds = float(sys.argv[2])
cycles = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "2,10,25,50,100,200").split(",")]
duties = [float(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "0.25,0.5,0.75").split(",")]

nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()
dev = ctypes.c_void_p()
nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))


class FieldValue(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_int), ("nvmlReturn", ctypes.c_int),
                ("value", ctypes.c_ulonglong)]


NVML_FI_DEV_POWER_INSTANT = 186


def sample():
    mhz = ctypes.c_uint()
    nvml.nvmlDeviceGetClockInfo(dev, 1, ctypes.byref(mhz))  # NVML_CLOCK_SM
    fv = FieldValue(fieldId=NVML_FI_DEV_POWER_INSTANT)
    nvml.nvmlDeviceGetFieldValues(dev, 1, ctypes.byref(fv))
    watts = fv.value / 1000.0 if fv.nvmlReturn == 0 else float("nan")
    return mhz.value, watts


state = {"on": False, "samples": [], "run": True}


def sampler():
    while state["run"]:
        mhz, w = sample()
        state["samples"].append((time.monotonic(), state["on"], mhz, w))
        time.sleep(0.001)


threading.Thread(target=sampler, daemon=True).start()

a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(20):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize()
ev = [torch.cuda.Event() for _ in range(4)]


def busy_until(deadline):
    """Launches matmuls until the wall clock reaches deadline, at most 4 events queued."""
    k = 0
    done = 0
    while time.monotonic() < deadline:
        torch.matmul(a, b, out=c)
        done += 1
        e = ev[k % 4]
        if k >= 4:
            e.synchronize()
        e.record()
        k += 1
    torch.cuda.synchronize()
    return done


def stats(t0, t1, on):
    s = [x for x in state["samples"] if t0 <= x[0] <= t1 and x[1] == on]
    if not s:
        return "-", "-"
    return f"{statistics.median(x[2] for x in s):.0f}", f"{statistics.median(x[3] for x in s):.0f}"


def unlimited():
    state["on"] = True
    busy_until(time.monotonic() + 1.0)  # settle at the capped clock
    t0 = time.monotonic()
    count = busy_until(t0 + seconds)
    t1 = time.monotonic()
    state["on"] = False
    mhz, w = stats(t0 + 0.2, t1, True)
    return count / (t1 - t0), mhz, w


base, mhz, w = unlimited()
print(f"unlimited n={n}: {base:.1f} matmul/s  sm={mhz} MHz  power={w} W", flush=True)
print(f"{'duty':>5} {'cycle_ms':>8} {'%unlim':>7} {'err':>6} {'on_MHz':>6} {'on_W':>5} {'off_W':>5}")
for duty in duties:
    for cyc in cycles:
        time.sleep(0.3)  # let the GPU cool from the previous setting alike for all
        on_s, cyc_s = duty * cyc / 1000.0, cyc / 1000.0
        t0 = time.monotonic()
        count = 0
        start = t0
        while start - t0 < seconds:
            state["on"] = True
            count += busy_until(start + on_s)
            state["on"] = False
            start += cyc_s
            pause = start - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        t1 = time.monotonic()
        rate = count / (t1 - t0)
        pct = 100.0 * rate / base
        on_mhz, on_w = stats(t0 + 0.2, t1, True)
        _, off_w = stats(t0 + 0.2, t1, False)
        print(f"{duty * 100:5.0f} {cyc:8.0f} {pct:7.1f} {pct - duty * 100:+6.1f} {on_mhz:>6} {on_w:>5} {off_w:>5}", flush=True)
base2, mhz2, w2 = unlimited()
print(f"unlimited again: {base2:.1f} matmul/s ({100 * base2 / base:.1f}% of the first)  sm={mhz2} MHz  power={w2} W")

# One trace: the clock and power through a 50% cycle of 200 ms, to see how fast the
# power controller reacts to a busy spell.
state["samples"].clear()
t0 = time.monotonic()
start = t0
for _ in range(3):
    state["on"] = True
    busy_until(start + 0.1)
    state["on"] = False
    start += 0.2
    time.sleep(max(0.0, start - time.monotonic()))
state["run"] = False
time.sleep(0.01)
print("trace (ms since start, on, MHz, W), every 5th sample:")
for i, (t, on, m, w) in enumerate(state["samples"]):
    if i % 5 == 0:
        print(f"  {1000 * (t - t0):7.1f} {int(on)} {m:5d} {w:6.0f}")
