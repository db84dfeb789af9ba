"""Share mode and priority on a real GPU (issue 17): one table per question, in one run.

usage: python3 gpu-tests/sm_limit/elastic.py <dir-with-libvgpu.so> [--out DIR]

Each "container" is a process with its own shared file (CUDA_DEVICE_MEMORY_SHARED_CACHE);
they coordinate through a fresh turn directory (VGPU_TURN_DIR) per scenario. Modes:
plain (no hook: the GPU time-slices), cap (today's CUDA_DEVICE_SM_LIMIT, turns), share
(VGPU_SM_MODE=share; priority pairs add CUDA_TASK_PRIORITY, 0 = high).
Tables (written to DIR/elastic.md, raw results to DIR/elastic.json):
 1. 30/70 both busy, compute loop (spin.cu, 50 us kernels) and bf16 matmul: % of alone
    (target: within 3 points of 30/70 in share mode).
 2. share mode, matmul: the 70% tenant idle from 3 s to 6 s: time series in 50 ms bins;
    the 30% tenant must reach >= 90% of alone within 250 ms, the 70% >= 65% within 250 ms of
    resuming (a 100 ms moving average, so one bin's jitter does not decide).
 3. share mode, matmul: four at 10/20/30/40, each idle 2 s in turn: each busy one at least
    its share, the sum (device busy) >= 95%.
 4. priority: batch-1 inference of a small GPT-2 (from a config) beside a best-effort
    training loop: p50/p99 vs alone (target <= 1.25x) and training vs alone (>= 50%),
    under plain, cap (70/30) and share+priority.
Runs in about 4-5 minutes.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LOAD = os.path.join(HERE, "elastic_load.py")
START_DELAY = 10.0  # torch import and CUDA start-up of every tenant fit in this


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("libdir")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
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
            CUDA_DEVICE_MEMORY_SHARED_CACHE=os.path.join(self.work, f"c{self.n}.cache"),
            VGPU_TURN_DIR=turns,
            LIBCUDA_LOG_LEVEL="2",
        )
        if sm is not None:
            env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
        if mode == "share":
            env["VGPU_SM_MODE"] = "share"
        if priority is not None:
            env["CUDA_TASK_PRIORITY"] = str(priority)
        return env

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
        out = []
        for p in procs:
            try:
                so, se = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                so, se = p.communicate()
            line = next((l for l in so.splitlines() if l.startswith("RESULT")), None)
            if line is None:
                print(f"  [{label}] failed (rc {p.returncode}): {se[-800:]}", file=sys.stderr)
                out.append(None)
            elif line.startswith("RESULT {"):
                out.append(json.loads(line[len("RESULT "):]))
            else:  # spin: RESULT key=value ...
                out.append({k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])})
        self.raw[label] = out
        return out

    def load(self, kind, seconds, start, *extra):
        return [sys.executable, LOAD, kind, str(seconds), "--start-at", str(start), *extra]


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


def main():
    args = parse()
    lib = os.path.join(os.path.abspath(args.libdir), "libvgpu.so")
    if not os.path.isfile(lib):
        sys.exit(f"no {lib}")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="vgpu-elastic-")
    b = Bench(lib, work)
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    t_begin = time.time()
    spin = os.path.join(work, "spin")
    subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", spin, os.path.join(HERE, "spin.cu")], check=True)
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()
    say(f"# Share mode and priority on {gpu}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    # Alone, no hook: the references.
    bare = subprocess.run([spin, "50", "3", "plain"], capture_output=True, text=True).stdout
    sres = dict(kv.split("=") for kv in bare.split("RESULT", 1)[1].split())
    iters = sres["iters"]
    spin_alone = float(sres["kernels_per_s"])
    start = time.time() + START_DELAY
    (mm_alone,) = b.together("matmul alone", [(b.env("plain"), b.load("matmul", 3, start))])
    mm_alone = mm_alone and mm_alone["rate"]

    # 1. 30/70 both busy.
    say("\n## 1. Two containers at 30/70, both busy (% of alone; target 30/70 +-3 in share mode)\n")
    say("| workload | mode | 30% tenant | 70% tenant | sum |")
    say("|---|---|---|---|---|")
    for wl in ("spin 50us", "matmul 4096 bf16"):
        for mode in ("plain", "cap", "share"):
            turns = b.turns()
            start = time.time() + (2.0 if wl.startswith("spin") else START_DELAY)
            if wl.startswith("spin"):
                env = {"SPIN_START_AT": str(start)}
                argv = [spin, "50", "4", "plain", iters]
                key, base = "kernels_per_s", spin_alone
            else:
                env, argv, key, base = {}, b.load("matmul", 4, start), "rate", mm_alone
            tenants = []
            for sm in (30, 70):
                e = b.env(mode, sm=sm, turns=turns)
                e.update(env)
                tenants.append((e, argv))
            r = b.together(f"pair {wl} {mode}", tenants)
            a, c = (pct(x and x[key], base) for x in r)
            s = None if a is None or c is None else a + c
            say(f"| {wl} | {mode} | {fmt(a)} | {fmt(c)} | {fmt(s)} |")

    # 2. Lending and taking back (share mode, matmul).
    say("\n## 2. Share mode 30/70, the 70% tenant idle from 3 s to 6 s (matmul)\n")
    turns = b.turns()
    start = time.time() + START_DELAY
    ra, rb = b.together(
        "idle and resume",
        [
            (b.env("share", sm=30, turns=turns), b.load("matmul", 9, start)),
            (b.env("share", sm=70, turns=turns), b.load("matmul", 9, start, "--idle", "3:6")),
        ],
    )
    if ra and rb and mm_alone:
        bin_s = ra["bin_s"]
        fa = [x / mm_alone for x in ra["bins"]]
        fb = [x / mm_alone for x in rb["bins"]]
        lend = first_reach(fa, bin_s, 3.0, 0.90)
        back = first_reach(fb, bin_s, 6.0, 0.65)
        ok = lambda t: "PASS" if t is not None and t <= 0.25 else "FAIL"
        say(f"- 30% tenant reaches 90% of alone {fmt(lend and lend * 1e3, '.0f')} ms after the 70% went idle: {ok(lend)}")
        say(f"- 70% tenant back at 65% {fmt(back and back * 1e3, '.0f')} ms after resuming: {ok(back)}")
        mean = lambda f, t0, t1: 100 * statistics.mean(f[int(t0 / bin_s):int(t1 / bin_s)])
        say(f"- both busy (1-3 s): {mean(fa, 1, 3):.1f} / {mean(fb, 1, 3):.1f}; 70% idle (3.25-6 s): 30% at {mean(fa, 3.25, 6):.1f}; "
            f"after (6.25-9 s): {mean(fa, 6.25, 9):.1f} / {mean(fb, 6.25, 9):.1f}")
        say("- time series (% of alone, 100 ms means), t: 30% / 70%")
        k = int(round(0.1 / bin_s))
        series = [
            f"{i * bin_s:.1f}: {100 * statistics.mean(fa[i:i + k]):.0f}/{100 * statistics.mean(fb[i:i + k]):.0f}"
            for i in range(int(2.5 / bin_s), int(7 / bin_s), k)
        ]
        say("  " + ", ".join(series))

    # 3. Four tenants, one idle at a time.
    say("\n## 3. Share mode 10/20/30/40, each idle 2 s in turn (matmul; % of alone, phase minus its first 250 ms)\n")
    shares = (10, 20, 30, 40)
    turns = b.turns()
    start = time.time() + START_DELAY
    rs = b.together(
        "four",
        [
            (b.env("share", sm=s, turns=turns),
             b.load("matmul", 10, start, "--idle", f"{2 * (i + 1)}:{2 * (i + 2)}"))
            for i, s in enumerate(shares)
        ],
    )
    say("| phase | " + " | ".join(f"{s}%" for s in shares) + " | sum | verdict |")
    say("|---|" + "---|" * (len(shares) + 2))
    if all(rs) and mm_alone:
        bin_s = rs[0]["bin_s"]
        for phase in range(5):
            t0, t1 = 2 * phase + 0.25, 2 * phase + 2
            got = [100 * statistics.mean(r["bins"][int(t0 / bin_s):int(t1 / bin_s)]) / mm_alone for r in rs]
            busy = [i for i in range(4) if phase != i + 1]
            ok = all(got[i] >= shares[i] for i in busy) and sum(got) >= 95
            name = "all busy" if phase == 0 else f"{shares[phase - 1]}% idle"
            say(f"| {name} | " + " | ".join(f"{g:.1f}" for g in got) + f" | {sum(got):.1f} | {'PASS' if ok else 'FAIL'} |")

    # 4. Priority: inference beside training.
    say("\n## 4. Batch-1 inference (GPT-2 6x512, 128 tokens, a request every 10 ms) beside a training loop\n")
    start = time.time() + START_DELAY
    (inf_alone,) = b.together("infer alone", [(b.env("plain"), b.load("infer", 8, start))])
    start = time.time() + START_DELAY
    (tr_alone,) = b.together("train alone", [(b.env("plain"), b.load("train", 8, start))])
    say("| mode | p50 ms | p99 ms | p50 / alone | p99 / alone | training % of alone | verdict |")
    say("|---|---|---|---|---|---|---|")
    if inf_alone:
        say(f"| alone | {inf_alone['p50_ms']:.2f} | {inf_alone['p99_ms']:.2f} | 1 | 1 | - | |")
    for mode, (si, st), (pi, pt) in (
        ("plain", (None, None), (None, None)),
        ("cap 70/30", (70, 30), (None, None)),
        ("share, priority 0/1", (None, None), (0, 1)),
    ):
        m = mode.split()[0].rstrip(",")
        turns = b.turns()
        start = time.time() + START_DELAY
        ri, rt = b.together(
            f"priority {mode}",
            [
                (b.env(m, sm=si, priority=pi, turns=turns), b.load("infer", 8, start)),
                (b.env(m, sm=st, priority=pt, turns=turns), b.load("train", 8, start)),
            ],
        )
        if not (ri and rt and inf_alone and tr_alone):
            say(f"| {mode} | failed | | | | | |")
            continue
        r50, r99 = ri["p50_ms"] / inf_alone["p50_ms"], ri["p99_ms"] / inf_alone["p99_ms"]
        tr = 100 * rt["rate"] / tr_alone["rate"]
        ok = r50 <= 1.25 and r99 <= 1.25 and tr >= 50
        say(f"| {mode} | {ri['p50_ms']:.2f} | {ri['p99_ms']:.2f} | {r50:.2f} | {r99:.2f} | {tr:.1f} | {'PASS' if ok else 'FAIL'} |")

    say(f"\nruntime {time.time() - t_begin:.0f} s")
    with open(os.path.join(args.out, "elastic.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "elastic.json"), "w") as f:
        json.dump(b.raw, f)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
