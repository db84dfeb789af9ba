"""Power and throughput of duty-cycled work, from NVML's energy counter (no hook involved).

usage: python3 power_probe.py <seconds> [workload,...]

workloads: mm4096, mm8192 (bf16 matmuls) and sleep (torch.cuda._sleep spin kernels, ~50 µs).
For each workload it runs the loop unlimited and duty-cycled by hand (10 ms cycles, duties
10/25/50/75/100%) and prints throughput relative to unlimited, average power over the run
(from nvmlDeviceGetTotalEnergyConsumption), and the "dynamic power per busy second"
e = (P - P_idle) / duty, where P_idle is the GPU's power idling with a context after work,
measured the same way. If throughput per dynamic joule is the same at every duty (clock), a
limit on the share of the power budget above idle holds throughput under power capping.
Also prints the idle power cold (before CUDA) and at several delays after work stops.
"""
import ctypes
import sys
import time

seconds = float(sys.argv[1])
loads = (sys.argv[2] if len(sys.argv) > 2 else "mm4096,mm8192,sleep").split(",")

nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()
dev = ctypes.c_void_p()
nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))


def energy_mj():
    e = ctypes.c_ulonglong()
    rc = nvml.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(e))
    assert rc == 0, rc
    return e.value


def clock():
    mhz = ctypes.c_uint()
    nvml.nvmlDeviceGetClockInfo(dev, 1, ctypes.byref(mhz))
    return mhz.value


def limit_w():
    mw = ctypes.c_uint()
    nvml.nvmlDeviceGetEnforcedPowerLimit(dev, ctypes.byref(mw))
    return mw.value / 1000.0


def avg_power(fn):
    """Runs fn(); returns (its result, average watts over it, seconds)."""
    e0, t0 = energy_mj(), time.monotonic()
    r = fn()
    e1, t1 = energy_mj(), time.monotonic()
    return r, (e1 - e0) / 1000.0 / (t1 - t0), t1 - t0


# Energy counter cadence: how often does its value change?
vals, t0 = [], time.monotonic()
while time.monotonic() - t0 < 0.3:
    vals.append((time.monotonic(), energy_mj()))
changes = [vals[i][0] - vals[0][0] for i in range(1, len(vals)) if vals[i][1] != vals[i - 1][1]]
steps = [round(1000 * (b - a), 1) for a, b in zip(changes, changes[1:])][:10]
print(f"enforced power limit {limit_w():.0f} W; energy counter changes every ~{steps} ms")
_, cold, _ = avg_power(lambda: time.sleep(1.0))
print(f"cold idle (no context): {cold:.1f} W, clock {clock()} MHz", flush=True)

import torch  # noqa: E402

torch.cuda.init()
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
for d in (0.0, 0.5, 1.0):
    _, p, _ = avg_power(lambda: time.sleep(0.5))
    print(f"context, no work, {d + 0.5:.1f} s after creation: {p:.1f} W, clock {clock()} MHz", flush=True)

ev = [torch.cuda.Event() for _ in range(4)]


def make(load):
    if load.startswith("mm"):
        n = int(load[2:])
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.matmul(a, b, out=c)
    return lambda: torch.cuda._sleep(50_000)  # ~25-50 µs of spinning


def busy_until(step, deadline):
    k = done = 0
    while time.monotonic() < deadline:
        step()
        done += 1
        if k >= 4:
            ev[k % 4].synchronize()
        ev[k % 4].record()
        k += 1
    torch.cuda.synchronize()
    return done


def duty_run(step, duty, cyc=0.010):
    t0 = time.monotonic()
    start, count = t0, 0
    while start - t0 < seconds:
        count += busy_until(step, start + duty * cyc)
        start += cyc
        pause = start - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return count


def idle_after(delays=(0.1, 0.3, 1.0)):
    out, prev = [], 0.0
    for d in delays:
        _, p, _ = avg_power(lambda: time.sleep(d - prev))
        out.append(f"{p:.0f}")
        prev = d
    return out


for load in loads:
    step = make(load)
    busy_until(step, time.monotonic() + 1.0)
    n0, p_full, dt = avg_power(lambda: busy_until(step, time.monotonic() + seconds))
    base, mhz = n0 / dt, clock()
    idle = idle_after()
    p_idle = float(idle[-1])
    print(f"\n{load}: unlimited {base:.1f}/s at {p_full:.0f} W, {mhz} MHz; idle after work "
          f"(0-0.1, 0.1-0.3, 0.3-1.0 s): {idle} W")
    print(f"{'duty':>5} {'%unlim':>7} {'P_W':>6} {'MHz':>5} {'e_W':>6} {'work/dynJ':>9}")
    for duty in (0.1, 0.25, 0.5, 0.75, 1.0):
        count, p, dt = avg_power(lambda: duty_run(step, duty))
        mhz = clock()
        pct = 100.0 * count / dt / base
        e = (p - p_idle) / duty
        per_j = (pct / 100.0) / ((p - p_idle) / (p_full - p_idle))
        print(f"{duty * 100:5.0f} {pct:7.1f} {p:6.0f} {mhz:5d} {e:6.0f} {per_j:9.3f}", flush=True)
        time.sleep(0.5)
