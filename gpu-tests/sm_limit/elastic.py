"""Share mode and priority on a real GPU (issue 17): one table per question, in one run.

usage: python3 gpu-tests/sm_limit/elastic.py <dir-with-libvgpu.so> [--out DIR]

Each "container" is a process with its own shared file (CUDA_DEVICE_MEMORY_SHARED_CACHE);
they coordinate through a fresh turn directory (VGPU_TURN_DIR) per scenario. Modes:
plain (no hook: the GPU time-slices), cap (today's CUDA_DEVICE_SM_LIMIT, turns), share
(VGPU_SM_MODE=share; priority pairs add CUDA_TASK_PRIORITY, 0 = high).
Tables (written to DIR/elastic.md, raw results to DIR/elastic.json):
 1. 30/70 both busy, compute loop (spin.cu, 50 us kernels) and bf16 matmul: % of alone
    (target: within 3 points of 30/70 in share mode); the matmul rows also against the 70%
    tenant alone for the last 1.5 s of the same run (plain and share mode).
 2. share mode, matmul: the 70% tenant idle from 3 s to 6 s: time series in 50 ms bins;
    the 30% tenant must reach >= 90% of alone within 250 ms, the 70% >= 65% within 250 ms of
    resuming (a 100 ms moving average, so one bin's jitter does not decide).
    `vgpu status --json` (the CLI next to libvgpu.so) is read at 5 s and 8.5 s: each
    tenant's part, utilization, lent and borrowed time as an operator sees them.
 3. share mode, matmul: four at 10/20/30/40, each idle 2 s in turn, then the 40% one alone
    (the run's own reference): each busy one at least its share of the device's busy time,
    the device busy (NVML) >= 95%; the four under plain time-slicing for comparison.
 4. priority: batch-1 inference of a small GPT-2 (from a config) beside a best-effort
    training loop, each also alone in the same run (one 24 s timeline per mode in 1.5 s
    slots: service alone, both, best-effort alone, both, four times): p50/p99 vs alone
    (target <= 1.25x) and training vs alone (>= 50%), under plain, cap (70/30) and
    share+priority; then beside a matmul loop that keeps the GPU full, plain and
    share+priority.
 5. live changes, share mode, matmul: two busy tenants, one change 3 s in made with the
    `vgpu` CLI next to libvgpu.so: `set-limit --sm` swaps 30/70 to 70/30, and `set-limit
    --priority 0` lifts one of two 10/10 tenants above the other (it then borrows first: about
    90/10). Each tenant's part of the pair's launches; the new split (over 400 ms, within 3
    points) must hold within 1 s of the change.
Runs in about 7 minutes.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LOAD = os.path.join(HERE, "elastic_load.py")
START_DELAY = 10.0  # torch import and CUDA start-up of every tenant fit in this


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("libdir")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--tables", default="1,2,3,4,5", help="which tables, e.g. 3,4")
    p.add_argument("--hook-cost", action="store_true",
                   help="only the service bare and under each hook mode, in turns (no tables)")
    p.add_argument("--no-plain-reference", dest="plain_reference", action="store_false",
                   help="table 3 without the four under plain time-slicing")
    return p.parse_args()


class Bench:
    def __init__(self, lib, work):
        self.lib, self.work, self.n = lib, work, 0
        self.raw = {}

    def env(self, mode, sm=None, priority=None, turns=None):
        """Environment of one tenant: `mode` plain (no hook), cap or share."""
        env = dict(os.environ)
        if mode == "plain":
            return env
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


def main():
    args = parse()
    lib = library(args.libdir)
    work = tempfile.mkdtemp(prefix="vgpu-elastic-")
    b = Bench(lib, work)
    say = Report(os.path.join(args.out, "elastic.md"))

    t_begin = time.time()
    tables = set() if args.hook_cost else {int(t) for t in args.tables.split(",")}
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()
    say(f"# Share mode and priority on {gpu}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    # Alone, no hook: the references (table 3 has its own, in the run).
    spin = iters = spin_alone = mm_alone = None
    if 1 in tables:
        spin = os.path.join(work, "spin")
        subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", spin, os.path.join(HERE, "spin.cu")], check=True)
        bare = subprocess.run([spin, "50", "3", "plain"], capture_output=True, text=True).stdout
        sres = dict(kv.split("=") for kv in bare.split("RESULT", 1)[1].split())
        iters = sres["iters"]
        spin_alone = float(sres["kernels_per_s"])
    if args.hook_cost:
        say("\n## The hook's own cost to batch-1 inference (GPT-2 6x512, a request every 10 ms)\n")
        hook_cost(b, say, HOOK_COST_VARIANTS)
    elif tables & {1, 2} or args.plain_reference:
        start = time.time() + START_DELAY
        (mm_alone,) = b.together("matmul alone", [(b.env("plain"), b.load("matmul", 3, start))])
        mm_alone = mm_alone and mm_alone["rate"]

    if 1 in tables:
        table1(b, say, spin, iters, spin_alone, mm_alone)
    if 2 in tables:
        table2(b, say, mm_alone, os.path.join(os.path.dirname(lib), "vgpu"))
    if 3 in tables:
        table3(b, say, mm_alone, args.plain_reference, os.path.join(os.path.dirname(lib), "vgpu"))
    if 4 in tables:
        table4(b, say)
    if 5 in tables:
        table5(b, say, os.path.join(os.path.dirname(lib), "vgpu"))
    say(f"\nruntime {time.time() - t_begin:.0f} s")
    with open(os.path.join(args.out, "elastic.json"), "w") as f:
        json.dump(b.raw, f)
    shutil.rmtree(work, ignore_errors=True)


def table1(b, say, spin, iters, spin_alone, mm_alone):
    # 1. 30/70 both busy. The matmul pairs also carry their own reference: the 70% tenant
    # runs on alone for PAIR_ALONE_S after the 30% one stops (the GPU's clock under
    # sustained matmuls drifts between separate runs); cap mode holds its cap alone too, so
    # there only the separate reference applies.
    say("\n## 1. Two containers at 30/70, both busy (% of alone; target 30/70 +-3 in share mode)\n")
    say("Matmul rows: also % of the 70% tenant's rate alone at the end of the same run "
        f"(its last {PAIR_ALONE_S:.1f} s, the 30% tenant gone; plain and share mode).\n")
    say("| workload | mode | 30% tenant | 70% tenant | sum | 30% / 70% of the in-run alone |")
    say("|---|---|---|---|---|---|")
    for wl in ("spin 50us", "matmul 4096 bf16"):
        for mode in ("plain", "cap", "share"):
            turns = b.turns()
            start = time.time() + (2.0 if wl.startswith("spin") else START_DELAY)
            if wl.startswith("spin"):
                env = {"SPIN_START_AT": str(start)}
                argvs = [[spin, "50", "4", "plain", iters]] * 2
                key, base = "kernels_per_s", spin_alone
            else:
                env, key, base = {}, "rate", mm_alone
                argvs = [b.load("matmul", PAIR_S, start), b.load("matmul", PAIR_S + PAIR_ALONE_S, start)]
            tenants = []
            for sm, argv in zip((30, 70), argvs):
                e = b.env(mode, sm=sm, turns=turns)
                e.update(env)
                tenants.append((e, argv))
            r = b.together(f"pair {wl} {mode}", tenants)
            in_run = "" if wl.startswith("spin") else in_run_split(r, mode)
            if not wl.startswith("spin") and all(r):
                # The pair's rates over its own span (the 70% tenant's alone part left out).
                a, c = (pct(window_rate(x, 0.25, PAIR_S), base) for x in r)
            else:
                a, c = (pct(x and x[key], base) for x in r)
            s = None if a is None or c is None else a + c
            say(f"| {wl} | {mode} | {fmt(a)} | {fmt(c)} | {fmt(s)} | {in_run} |")


PAIR_S = 4.0
PAIR_ALONE_S = 1.5


def bins_mean(bins, bin_s, t0, t1=None):
    """Mean of per-bin values over [t0, t1) seconds (t1 None: to the end)."""
    end = None if t1 is None else int(round(t1 / bin_s))
    return statistics.mean(bins[int(round(t0 / bin_s)):end])


def window_rate(r, t0, t1=None):
    """Mean rate of a load's bins over [t0, t1) seconds."""
    return bins_mean(r["bins"], r["bin_s"], t0, t1)


def in_run_split(r, mode):
    """'30 / 70' as % of the 70% tenant's rate alone after the pair (plain and share)."""
    if mode == "cap" or not all(r):
        return ""
    alone = window_rate(r[1], PAIR_S + 0.25, PAIR_S + PAIR_ALONE_S)
    a, c = (100 * window_rate(x, 0.25, PAIR_S) / alone for x in r)
    return f"{a:.1f} / {c:.1f}"


def table2(b, say, mm_alone, vgpu=None):
    # 2. Lending and taking back (share mode, matmul); `vgpu status` read while the 70%
    # tenant idles and after it resumed (what an operator sees: part, lent, borrowed).
    say("\n## 2. Share mode 30/70, the 70% tenant idle from 3 s to 6 s (matmul)\n")
    turns = b.turns()
    start = time.time() + START_DELAY
    ea, eb = b.env("share", sm=30, turns=turns), b.env("share", sm=70, turns=turns)
    cache = ea["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    status = ["status", "--json", "--cache", cache]
    cli = CliAt(vgpu, start, [(5.0, status), (8.5, status)], env={"VGPU_TURN_DIR": turns})
    ra, rb = b.together(
        "idle and resume",
        [
            (ea, b.load("matmul", 9, start)),
            (eb, b.load("matmul", 9, start, "--idle", "3:6")),
        ],
    )
    seen = cli.join()
    if seen is not None:
        b.raw["idle and resume (vgpu status)"] = seen
        for (t, _at, text) in seen:
            say(f"- `vgpu status --json` at {t:.1f} s: {status_line(text)}")
    if ra and rb and mm_alone:
        bin_s = ra["bin_s"]
        fa = [x / mm_alone for x in ra["bins"]]
        fb = [x / mm_alone for x in rb["bins"]]
        lend = first_reach(fa, bin_s, 3.0, 0.90)
        back = first_reach(fb, bin_s, 6.0, 0.65)
        ok = lambda t: "PASS" if t is not None and t <= 0.25 else "FAIL"
        say(f"- 30% tenant reaches 90% of alone {fmt(lend and lend * 1e3, '.0f')} ms after the 70% went idle: {ok(lend)}")
        say(f"- 70% tenant back at 65% {fmt(back and back * 1e3, '.0f')} ms after resuming: {ok(back)}")
        mean = lambda f, t0, t1: 100 * bins_mean(f, bin_s, t0, t1)
        say(f"- both busy (1-3 s): {mean(fa, 1, 3):.1f} / {mean(fb, 1, 3):.1f}; 70% idle (3.25-6 s): 30% at {mean(fa, 3.25, 6):.1f}; "
            f"after (6.25-9 s): {mean(fa, 6.25, 9):.1f} / {mean(fb, 6.25, 9):.1f}")
        say("- time series (% of alone, 100 ms means), t: 30% / 70%")
        k = int(round(0.1 / bin_s))
        series = [
            f"{i * bin_s:.1f}: {100 * statistics.mean(fa[i:i + k]):.0f}/{100 * statistics.mean(fb[i:i + k]):.0f}"
            for i in range(int(2.5 / bin_s), int(7 / bin_s), k)
        ]
        say("  " + ", ".join(series))



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


def status_line(text):
    """The turn board's share records of device 0 in `vgpu status --json` output, one phrase
    each (this container first)."""
    try:
        turns = json.loads(text)["devices"][0]["turns"]
    except (ValueError, KeyError, IndexError, TypeError):
        return f"unreadable ({text[:200]!r})"
    said = []
    for t in sorted(turns, key=lambda t: not t.get("this_container")):
        sh = t.get("share")
        if not sh:
            continue
        said.append(f"{sh['share_percent']}% tenant{' (this file)' if t.get('this_container') else ''}: "
                    f"part {sh['part_percent']}%, utilization {sh['utilization_percent']}%, "
                    f"{'busy' if sh['busy'] else 'idle'}, lent {sh['lent_ms']} ms, borrowed {sh['borrowed_ms']} ms, "
                    f"priority {sh['priority']}, ceiling {sh['ceiling_percent']}%")
    return "; ".join(said) or "no share records"


def window_order(seen, shares):
    """The four tenants' windows in cycle order, from each tenant's `vgpu status --json`
    through its own file (`seen` as [`CliAt.join`] gives it, tenant `i` the `i`th): every
    tenant lays the windows out in ascending key order. Each with its part and launch length
    as its record said."""
    own = []
    for (share, (_t, _at, text)) in zip(shares, seen):
        try:
            turns = json.loads(text)["devices"][0]["turns"]
            me = next(t for t in turns if t.get("this_container"))
            own.append((int(me["key"], 16), share, me.get("share", {}).get("part_percent"), me.get("launch_us")))
        except (ValueError, KeyError, IndexError, TypeError, StopIteration):
            return f"unreadable ({text[:120]!r})"
    return " → ".join(f"{s}% (part {p}%, launch {l} µs)" for _k, s, p, l in sorted(own)) + " → (the first again)"


def four_phase_ok(got, dev, busy, shares, margin=0.5):
    """Table 3's verdict on one phase: the device at least 95% busy (NVML, percent; None:
    unknown, a failure) and each busy tenant (indices `busy`) with at least its share of the
    busy tenants' time (its guarantee plus what an idle one lends, in proportion to the
    guarantees), less `margin` points. `got`: each tenant's rate."""
    due = sum(shares[i] for i in busy)
    total = sum(got)
    return (dev is not None and dev >= 95 and total > 0
            and all(100 * got[i] / total >= 100 * shares[i] / due - margin for i in busy))


def table3(b, say, mm_alone, plain_reference=True, vgpu=None):
    # 3. Four tenants, one idle at a time, then the 40% one alone (the run's own reference:
    # the GPU's clock under sustained matmuls drifts by up to 10% between separate runs).
    say("\n## 3. Share mode 10/20/30/40, each idle 2 s in turn, then the 40% one alone (matmul)\n")
    say("Per phase (its first 250 ms not counted): each tenant's rate as % of the 40% tenant's rate "
        "alone in the last phase of the same run; each tenant's part of the device's busy time "
        "(its rate over the sum, times the busy time); the device's busy time from NVML "
        "(`utilization.gpu`, the time a kernel ran, sampled every 100 ms).\n")
    shares = (10, 20, 30, 40)
    turns = b.turns()
    start = time.time() + START_DELAY
    sampler = Busy(start)
    envs = [b.env("share", sm=s, turns=turns) for s in shares]
    # Each tenant's own record, read through its file while all four are busy: the keys give
    # the order of the windows in the cycle (every tenant lays them out by key).
    cli = CliAt(vgpu, start, [(1.0, ["status", "--json", "--cache", e["CUDA_DEVICE_MEMORY_SHARED_CACHE"]])
                              for e in envs], env={"VGPU_TURN_DIR": turns})
    rs = b.together(
        "four",
        [
            (env, b.load("matmul", 12, start, "--idle", f"{2 * (i + 1)}:{2 * (i + 2)}",
                         *(["--idle", "10:12"] if i < 3 else [])))
            for i, env in enumerate(envs)
        ],
    )
    busy_by_phase = sampler.stop()
    seen = cli.join()
    if seen is not None:
        b.raw["four (vgpu status)"] = seen
        say(f"Windows in the cycle while all four are busy (1 s in), in order: {window_order(seen, shares)}\n")
    say("| phase | " + " | ".join(f"{s}% (% of alone / part of busy)" for s in shares)
        + " | sum % of alone | device busy (NVML) | verdict |")
    say("|---|" + "---|" * (len(shares) + 3))
    if all(rs):
        alone = window_rate(rs[3], 10.25, 12)
        for phase in range(5):
            t0, t1 = 2 * phase + 0.25, 2 * phase + 2
            got = [window_rate(r, t0, t1) for r in rs]
            busy = [i for i in range(4) if phase != i + 1]
            dev = busy_by_phase(t0, t1)
            part = [100 * g / sum(got) * (dev or 100) / 100 for g in got]
            ok = four_phase_ok(got, dev, busy, shares)
            name = "all busy" if phase == 0 else f"{shares[phase - 1]}% idle"
            cells = [f"{100 * g / alone:.1f} / {p:.1f}" for g, p in zip(got, part)]
            say(f"| {name} | " + " | ".join(cells) + f" | {sum(100 * g / alone for g in got):.1f} | "
                f"{fmt(dev)} | {'PASS' if ok else 'FAIL'} |")
        say(f"| 40% alone (reference) | | | | 100 | | {fmt(busy_by_phase(10.25, 12))} | |")
    say("\nEach tenant's limiter at exit (LIBCUDA_LOG_LEVEL=3):\n")
    for line in (l for ls in b.raw["four (limiter stats)"] for l in ls):
        say("    " + line.split("] ", 1)[-1])
    # The same four busy under plain time-slicing (no hook), with the same NVML reading.
    if not plain_reference:
        return
    start = time.time() + START_DELAY
    sampler = Busy(start)
    plain = b.together("four plain", [(b.env("plain"), b.load("matmul", 4, start)) for _ in shares])
    dev = sampler.stop()(0.25, 4)
    if all(plain) and mm_alone:
        got = [pct(r["rate"], mm_alone) for r in plain]
        say(f"\nPlain time-slicing, the four busy: {' / '.join(f'{g:.1f}' for g in got)} % of one alone "
            f"(a separate run), sum {sum(got):.1f}; device busy (NVML) {fmt(dev)}.")



def table4(b, say):
    # 4. Priority: inference beside a best-effort loop. Both run through one timeline of
    # alternating slots, so each is compared with itself alone in the same run.
    seconds, counted, service_idle, other_idle = priority_schedule()
    say("\n## 4. Batch-1 inference (GPT-2 6x512, 128 tokens, a request every 10 ms) beside a training loop, then beside a matmul loop\n")
    say(f"One {seconds:g} s timeline per mode, in {PRIORITY_SLOT_S:g} s slots: the service alone, "
        f"both, the best-effort loop alone, both, {len(PRIORITY_PATTERN) // 4} times over (each "
        f"slot's first {PRIORITY_SETTLE_S:g} s not counted). Ratios against the same process "
        "alone in the same run; `bare` columns against inference alone without the hook (the "
        "bare slots of the run just before, for the hook's own cost).\n")
    inf_alone = hook_cost(b, say)
    say("| mode | p50 ms alone / both | p99 ms alone / both | p50 both / alone | p99 both / alone "
        "| p50, p99 both / plain both | p50 both / bare | best-effort both, % of alone | verdict |")
    say("|---|---|---|---|---|---|---|---|---|")
    plain, medians = {}, []
    for mode, (si, st), (pi, pt), other in PRIORITY_ROWS:
        m = mode.split()[0].rstrip(",")
        turns = b.turns()
        start = time.time() + START_DELAY
        ri, rt = b.together(
            f"priority {mode}",
            [
                (b.env(m, sm=si, priority=pi, turns=turns),
                 b.load("infer", seconds, start, *idle_args(service_idle), "--stamps")),
                (b.env(m, sm=st, priority=pt, turns=turns),
                 b.load(other, seconds, start, *idle_args(other_idle), "--stamps")),
            ],
        )
        say(priority_line(mode, ri, rt, inf_alone, plain.get(other), counted))
        if m == "plain" and ri and rt:
            plain[other] = priority_figures(ri, rt, counted)
        if ri and "stamps" in ri:
            medians.append((mode, slot_medians(ri, counted) + gpu_wait(ri, counted)))
    say(f"\n{SLOT_MEDIANS_LEGEND}\n")
    for mode, m in medians:
        say(f"- {mode}: {m}")


# The hooked service of table 4's share rows: share mode, priority 0, alone on its board.
HOOKED_SERVICE = (("share mode, priority 0, alone", "share", {"priority": 0}),)
# `--hook-cost`: the same service under each way the hook can run it.
HOOK_COST_VARIANTS = (
    ("hooked, no SM limit", "cap", {}),
    ("hooked, cap 90%", "cap", {"sm": 90}),
    ("hooked, share mode, best effort", "share", {}),
    *HOOKED_SERVICE,
)


def hook_cost(b, say, variants=HOOKED_SERVICE, rounds=4):
    """The service bare and under each of `variants` [(label, mode, Bench.env keywords)],
    taking turns in 1.5 s slots (`rounds` times each), each idle while another runs: the
    hook's own cost to a launch-bound service, against the same host at the same time (the
    host's speed wanders on a scale of seconds). Says one line per variant; returns the
    bare figures ({"p50_ms", "p99_ms"}) or None."""
    slot, settle = PRIORITY_SLOT_S, PRIORITY_SETTLE_S
    k = len(variants) + 1
    n = k * rounds
    mine = lambda j: [(i * slot, (i + 1) * slot) for i in range(n) if i % k == j]
    others = lambda j: [r for i in range(k) if i != j for r in mine(i)]
    counted = lambda j: [(a + settle, b_) for a, b_ in mine(j)]
    start = time.time() + START_DELAY
    # Each hooked one on a board of its own: alone there, as a tenant alone on a GPU.
    envs = [b.env("plain")] + [b.env(mode, turns=b.turns(), **kw) for _, mode, kw in variants]
    runs = b.together("infer bare and hooked", [
        (env, b.load("infer", n * slot, start, *idle_args(sorted(others(j))), "--stamps"))
        for j, env in enumerate(envs)])
    if not all(runs):
        say("The service bare and hooked in turns: failed.\n")
        return None

    def figures(r, phases):
        at = [i for i, t in enumerate(r["stamps"]) if any(a <= t < b_ for a, b_ in phases)]
        return sorted(r["lat"][i] for i in at), sorted(r["host_ms"][i] for i in at)

    figs = [figures(r, counted(j)) for j, r in enumerate(runs)]
    (lb, hb) = figs[0]
    if not all(f[0] for f in figs):
        say("The service bare and hooked in turns: no samples.\n")
        return None
    q = quantile
    say(f"The service bare and hooked, taking turns in {slot:g} s slots over {n * slot:g} s "
        f"({rounds} slots each; bare p50 {q(lb, 0.5):.2f} ms, p99 {q(lb, 0.99):.2f} ms):\n")
    for (label, _, _), (lh, hh) in zip(variants, figs[1:]):
        say(f"- {label}: p50 {q(lh, 0.5):.2f} ms, p99 {q(lh, 0.99):.2f} ms; hooked / bare p50 "
            f"{q(lh, 0.5) / q(lb, 0.5):.2f}×, p99 {q(lh, 0.99) / q(lb, 0.99):.2f}×, host launch "
            f"time p50 {q(hh, 0.5) / q(hb, 0.5):.2f}×")
    say("")
    return {"p50_ms": q(lb, 0.5), "p99_ms": q(lb, 0.99)}


# Table 4's timeline: slots in the order of PRIORITY_PATTERN, "A" the service alone (the
# best-effort tenant idle), "B" both, "C" the best-effort tenant alone (the service idle).
# The service's latency wanders on a scale of seconds whatever the condition (in runs 10-18,
# one 15 s timeline with two phases per condition, its two alone phases were up to 2.5 ms
# apart), so each condition is sampled in many short slots spread over the run.
PRIORITY_SLOT_S = 1.5
PRIORITY_SETTLE_S = 0.5  # a slot's start is not counted: lending and holding switch over
PRIORITY_PATTERN = "ABCB" * 4
# The counted phases of runs 10-18's timeline (their saved elastic.json).
PRIORITY_PHASES_UNTIL_RUN18 = {"A": [(0.5, 3), (13.5, 15)], "B": [(3.5, 7), (10, 13)], "C": [(7.5, 9.5)]}


def priority_schedule(pattern=PRIORITY_PATTERN, slot=PRIORITY_SLOT_S, settle=PRIORITY_SETTLE_S):
    """(seconds, the counted part of each condition's slots {"A"|"B"|"C": [(t0, t1)]}, the
    service's idle ranges, the best-effort tenant's idle ranges)."""
    slots = {"A": [], "B": [], "C": []}
    for i, c in enumerate(pattern):
        slots[c].append((i * slot, (i + 1) * slot))
    counted = {c: [(a + settle, b_) for a, b_ in v] for c, v in slots.items()}
    return len(pattern) * slot, counted, slots["C"], slots["A"]


def idle_args(ranges):
    """elastic_load.py's --idle arguments for `ranges` [(a, b)] seconds."""
    return [x for a, b_ in ranges for x in ("--idle", f"{a:g}:{b_:g}")]


# (label, SM limits, CUDA_TASK_PRIORITY of the service and of the best-effort tenant, what
# the best-effort tenant runs). The matmul loop (4096^3 bf16 back to back) keeps the GPU
# full, where time-slicing makes the service wait behind its queue; the training loop
# leaves it partly idle.
PRIORITY_ROWS = (
    ("plain", (None, None), (None, None), "train"),
    ("cap 70/30", (70, 30), (None, None), "train"),
    ("share, priority 0/1", (None, None), (0, 1), "train"),
    ("plain, beside matmuls", (None, None), (None, None), "matmul"),
    ("share, priority 0/1, beside matmuls", (None, None), (0, 1), "matmul"),
)


def priority_figures(ri, rt, counted):
    """Table 4's figures of one timeline (`counted`: its conditions' phases, as
    [`priority_schedule`] gives them): the service's sorted latencies alone and beside the
    best-effort tenant (by request start), and the best-effort tenant's rate beside the
    service as a fraction of its own alone, from its 50 ms bins."""
    lat = lambda phases: sorted(l for t, l in zip(ri["stamps"], ri["lat"])
                                if any(a <= t < b_ for a, b_ in phases))
    rate = lambda phases: sum(window_rate(rt, a, b_) * (b_ - a) for a, b_ in phases) / sum(
        b_ - a for a, b_ in phases)
    alone = rate(counted["C"])
    return {"alone": lat(counted["A"]), "both": lat(counted["B"]),
            "best_effort": rate(counted["B"]) / alone if alone else None}


SLOT_MEDIANS_LEGEND = ("The service's median latency in each counted slot, in timeline order "
                       "(A alone, B beside the best-effort loop), ms, and after the slash the "
                       "median time its host took to launch a request's kernels:")


def slot_medians(ri, counted):
    """The service's median latency (ms) in each counted slot of `counted` (as
    [`priority_schedule`] gives it), in timeline order, marked with its condition, and the
    median of its requests' host launch times there if recorded (`latency/host`)."""
    slots = sorted((a, b_, c) for c in "AB" for a, b_ in counted[c])
    host = ri.get("host_ms")
    out = []
    for a, b_, c in slots:
        at = [i for i, t in enumerate(ri["stamps"]) if a <= t < b_]
        if not at:
            out.append(f"{c}-")
            continue
        med = lambda v: sorted(v)[len(v) // 2]
        h = f"/{med([host[i] for i in at]):.1f}" if host else ""
        out.append(f"{c}{med([ri['lat'][i] for i in at]):.1f}{h}")
    return " ".join(out)


def gpu_wait(ri, counted):
    """The service's wait for the GPU (latency less its host launch time) in `counted`'s
    alone and both slots: "p50 A / B ms, p99 A / B ms", or "" without host launch times.
    Priority acts on this part; the rest is the host's (Python, the hook, the driver)."""
    host = ri.get("host_ms")
    if not host:
        return ""
    w = {c: sorted(l - h for t, l, h in zip(ri["stamps"], ri["lat"], host)
                   if any(a <= t < b_ for a, b_ in counted[c])) for c in "AB"}
    if not (w["A"] and w["B"]):
        return ""
    q = quantile
    return (f"; GPU wait p50 {q(w['A'], 0.5):.2f} / {q(w['B'], 0.5):.2f} ms, p99 "
            f"{q(w['A'], 0.99):.2f} / {q(w['B'], 0.99):.2f} ms (alone / both)")


def quantile(v, p):
    return v[min(len(v) - 1, int(len(v) * p))]


def priority_line(mode, ri, rt, inf_alone, plain=None, counted=None):
    """Table 4's row for one timeline (`counted` as for [`priority_figures`]; by default
    today's schedule); `plain` is the figures of the plain timeline beside the same
    best-effort load, if any (the column against it)."""
    if not (ri and rt):
        return f"| {mode} | failed | | | | | | | |"
    f = priority_figures(ri, rt, counted or priority_schedule()[1])
    la, lb, be = f["alone"], f["both"], f["best_effort"]
    if not (la and lb and be is not None):
        return (f"| {mode} | no samples (requests alone {len(la)}, both {len(lb)}; best-effort "
                f"alone {'none' if be is None else 'seen'}) | | | | | | | |")
    q = quantile
    r50, r99 = q(lb, 0.5) / q(la, 0.5), q(lb, 0.99) / q(la, 0.99)
    vs_plain = "" if not plain or mode.startswith("plain") or not plain["both"] else (
        f"{q(lb, 0.5) / q(plain['both'], 0.5):.2f}, {q(lb, 0.99) / q(plain['both'], 0.99):.2f}")
    bare = inf_alone and q(lb, 0.5) / inf_alone["p50_ms"]
    tr = 100 * be
    ok = r50 <= 1.25 and r99 <= 1.25 and tr >= 50
    return (f"| {mode} | {q(la, 0.5):.2f} / {q(lb, 0.5):.2f} | {q(la, 0.99):.2f} / {q(lb, 0.99):.2f} | "
            f"{r50:.2f} | {r99:.2f} | {vs_plain} | {fmt(bare, '.2f')} | {tr:.1f} | {'PASS' if ok else 'FAIL'} |")


def settle_time(a, b, bin_s, at, expect, span=3.0, tol=0.03, window=0.4):
    """Seconds after `at` until the first tenant's part of the pair (launch counts `a`, `b`
    per bin), over the last `window` s, is within `tol` of `expect` and stays so until
    `at + span`; None if it never does. The window holds ten 40 ms turn cycles: a 10%
    tenant's turn holds about 20 launches, and a 50 ms bin of host stamps can gain or lose
    one turn's worth, so over 200 ms its part wandered 7-11% around 10% (H200, 2026-12-01)."""
    k = max(1, int(round(window / bin_s)))
    part = []
    for i in range(len(a)):
        x, y = sum(a[max(0, i - k + 1):i + 1]), sum(b[max(0, i - k + 1):i + 1])
        part.append(x / (x + y) if x + y else 0.0)
    i0, i_end = int(at / bin_s), min(len(part), int(round((at + span) / bin_s)))
    for i in range(i0, i_end):
        if all(abs(v - expect) <= tol for v in part[i:i_end]):
            return (i + 1) * bin_s - at
    return None


def table5(b, say, vgpu):
    # 5. Live changes: the issue's "within 1 s" on the GPU. Each tenant's part of what the
    # pair got (not of a separate reference: the split is the question).
    say("\n## 5. Live changes in share mode (matmul, two busy tenants, one change 3 s in)\n")
    if not os.access(vgpu, os.X_OK):
        say(f"no `vgpu` CLI at {vgpu}: skipped")
        return
    say("Each tenant's part of the pair's launches; \"settled\": time after the change until "
        "the part over the last 400 ms is within 3 points of the new split and stays so for the "
        "3 s after the change (target: within 1 s; the 400 ms window itself is counted).\n")
    say("| change | before (1-3 s) | after (4.5-8 s) | expected after | settled | verdict |")
    say("|---|---|---|---|---|---|")
    cases = (
        # (share %, CUDA_TASK_PRIORITY) of each tenant; None: not set.
        ("set-limit --sm: 30/70 to 70/30", (30, None), (70, None), [["--sm", "70"], ["--sm", "30"]], 0.70),
        ("set-limit --priority 0 on the second of two at 10/10, priority 1", (10, 1), (10, 1),
         [None, ["--priority", "0"]], 0.10),
    )
    for label, (sa, pa), (sb, pb), changes, expect in cases:
        turns = b.turns()
        start = time.time() + START_DELAY
        ea = b.env("share", sm=sa, priority=pa, turns=turns)
        eb = b.env("share", sm=sb, priority=pb, turns=turns)
        caches = [ea["CUDA_DEVICE_MEMORY_SHARED_CACHE"], eb["CUDA_DEVICE_MEMORY_SHARED_CACHE"]]
        tenants = [(e, b.load("matmul", 8, start)) for e in (ea, eb)]
        cli = CliAt(vgpu, start, [(3.0, ["set-limit", *c, "--cache", path])
                                  for path, c in zip(caches, changes) if c])
        ra, rb = b.together(f"live {label}", tenants)
        done = cli.join()
        b.raw[f"live {label} (cli)"] = done
        if not (ra and rb and done):
            say(f"| {label} | failed | | | | |")
            continue
        bin_s, at = ra["bin_s"], done[0][1]
        t_settle = settle_time(ra["bins"], rb["bins"], bin_s, at, expect)
        split = lambda t0, t1: window_rate(ra, t0, t1) / (window_rate(ra, t0, t1) + window_rate(rb, t0, t1))
        before, after = split(1, 3), split(4.5, 8)
        ok = t_settle is not None and t_settle <= 1.0
        say(f"| {label} | {100 * before:.1f} / {100 * (1 - before):.1f} | {100 * after:.1f} / "
            f"{100 * (1 - after):.1f} | {100 * expect:.0f} / {100 * (1 - expect):.0f} | "
            f"{fmt(t_settle and t_settle * 1e3, '.0f')} ms | {'PASS' if ok else 'FAIL'} |")


if __name__ == "__main__":
    main()
