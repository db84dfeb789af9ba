"""What the GPU benches of share mode share: the tenants (processes preloading libvgpu.so or
not, each with its own shared file, on a turn directory of their scenario), the `vgpu` CLI
run beside them, NVML's busy time, the report, and the arithmetic on a tenant's 50 ms bins.
Used by elastic.py (its tables) and priority.py (tables 4 and 6).
"""
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LOAD = os.path.join(HERE, "elastic_load.py")

START_DELAY = 10.0  # torch import and CUDA start-up of every tenant fit in this


class Bench:
    def __init__(self, lib, work):
        self.lib, self.work, self.n = lib, work, 0
        self.raw = {}

    def env(self, mode, sm=None, priority=None, turns=None):
        """Environment of one tenant: `mode` plain (no hook), cap or share; a hooked one
        without `turns` gets a turn directory of its own (never the node's default)."""
        env = dict(os.environ)
        if mode == "plain":
            return env
        turns = turns or self.turns()
        self.n += 1
        env.update(
            LD_PRELOAD=self.lib,
            CUDA_DEVICE_MEMORY_SHARED_CACHE=self.cache(self.n),
            VGPU_TURN_DIR=turns,
            LIBCUDA_LOG_LEVEL="3",  # the limiter's counters at exit, kept in elastic.json
        )
        if sm is not None:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        if mode == "share":
            env["VGPU_SM_MODE"] = "share"
        if priority is not None:
            env["CUDA_TASK_PRIORITY"] = str(priority)
        return env

    def cache(self, n):
        """The shared file of the `n`th hooked tenant (`vgpu set-limit --cache`)."""
        return os.path.join(self.work, f"c{n}.cache")

    def turns(self):
        self.n += 1
        d = os.path.join(self.work, f"turns{self.n}")
        os.makedirs(d)
        return d

    def together(self, label, tenants, timeout=120):
        """Runs `tenants` [(env, argv)] at once; returns their RESULT dicts (None = failed)."""
        procs = []
        for env, argv in tenants:
            procs.append(
                subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        out, stats = [], []
        for p in procs:
            try:
                so, se = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                so, se = p.communicate()
            stats.append([l for l in se.splitlines() if "limiter stats" in l])
            line = next((l for l in so.splitlines() if l.startswith("RESULT")), None)
            if line is None:
                print(f"  [{label}] failed (rc {p.returncode}): {se[-800:]}", file=sys.stderr)
                out.append(None)
            elif line.startswith("RESULT {"):
                out.append(json.loads(line[len("RESULT "):]))
            else:  # spin: RESULT key=value ...
                out.append({k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])})
        self.raw[label] = out
        self.raw[label + " (limiter stats)"] = stats
        return out

    def load(self, kind, seconds, start, *extra):
        return [sys.executable, LOAD, kind, str(seconds), "--start-at", str(start), *extra]


class Busy:
    """The device's busy time from NVML (`utilization.gpu`, the time a kernel ran) sampled
    every 100 ms by nvidia-smi from now until stop(); stop() returns f(t0, t1) -> mean
    percent over [t0, t1) seconds after `t0_wall` (None without samples)."""

    def __init__(self, t0_wall):
        self.t0 = t0_wall
        self.p = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits",
             "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )

    def stop(self):
        self.p.terminate()
        so, _ = self.p.communicate()
        samples = []
        for line in so.splitlines():
            try:
                ts, util = (x.strip() for x in line.split(","))
                base, frac = ts.split(".") if "." in ts else (ts, "0")
                wall = time.mktime(time.strptime(base, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
                samples.append((wall - self.t0, float(util)))
            except ValueError:
                continue

        def mean(t0, t1):
            v = [u for t, u in samples if t0 <= t < t1]
            return statistics.mean(v) if v else None

        return mean


def pct(x, base):
    return None if x is None or not base else 100.0 * x / base


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def first_reach(bins, bin_s, t_from, target):
    """Seconds after t_from at which the 100 ms moving average of bins first reaches target."""
    k = max(1, int(round(0.1 / bin_s)))
    i0 = int(round(t_from / bin_s))
    for i in range(i0 + k, len(bins) + 1):
        if sum(bins[i - k:i]) / k >= target:
            return (i - i0) * bin_s
    return None


def library(libdir):
    """The libvgpu.so in `libdir` (exits if there is none)."""
    lib = os.path.join(os.path.abspath(libdir), "libvgpu.so")
    if not os.path.isfile(lib):
        sys.exit(f"no {lib}")
    return lib


class Report:
    """Markdown lines printed and written to `path` as they come: a run cut short keeps its
    tables so far. Call it with a line."""

    def __init__(self, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path, self.lines = path, []

    def __call__(self, s=""):
        print(s, flush=True)
        self.lines.append(s)
        with open(self.path, "w") as f:
            f.write("\n".join(self.lines) + "\n")


def bins_mean(bins, bin_s, t0, t1=None):
    """Mean of per-bin values over [t0, t1) seconds (t1 None: to the end)."""
    end = None if t1 is None else int(round(t1 / bin_s))
    return statistics.mean(bins[int(round(t0 / bin_s)):end])


def window_rate(r, t0, t1=None):
    """Mean rate of a load's bins over [t0, t1) seconds."""
    return bins_mean(r["bins"], r["bin_s"], t0, t1)


class CliAt:
    """Runs the `vgpu` CLI beside the tenants: each `(t, argv)` of `calls` at `t` seconds
    after `start` (wall clock), in a thread, with `env` added. join() returns
    [(t, seconds after start it ran, stdout)], or None without an executable `vgpu`."""

    def __init__(self, vgpu, start, calls, env=None):
        self.out = []
        self.thread = None
        if not (vgpu and os.access(vgpu, os.X_OK)):
            return
        env = dict(os.environ, **(env or {}))

        def run():
            for t, argv in calls:
                time.sleep(max(0.0, start + t - time.time()))
                at = time.time() - start
                r = subprocess.run([vgpu, *argv], capture_output=True, text=True, env=env)
                self.out.append((t, at, r.stdout.strip()))

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self):
        if self.thread is None:
            return None
        self.thread.join()
        return self.out


def idle_args(ranges):
    """elastic_load.py's --idle arguments for `ranges` [(a, b)] seconds."""
    return [x for a, b_ in ranges for x in ("--idle", f"{a:g}:{b_:g}")]


def quantile(v, p):
    return v[min(len(v) - 1, int(len(v) * p))]
