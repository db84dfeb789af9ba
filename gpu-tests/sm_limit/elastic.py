"""Share mode and priority on a real GPU (issue 17): one table per question, in one run.

usage: python3 gpu-tests/sm_limit/elastic.py <dir-with-libvgpu.so> [--out DIR]

Each "container" is a process with its own shared file (CUDA_DEVICE_MEMORY_SHARED_CACHE);
they meet on the board of a fresh board directory (VGPU_TURN_DIR) per scenario. Modes:
plain (no hook: the GPU time-slices), cap (CUDA_DEVICE_SM_LIMIT, HAMi's meaning), share
(VGPU_SM_MODE=share; priority pairs add CUDA_TASK_PRIORITY, 0 = high). The compute bench
(gpu-tests/compute) asks the same questions of real training and serving workloads; these
tables keep the synthetic loops whose timing is easy to read.
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
 6. (only with --tables 6) a sparse service, a request every 0.7 s, beside a matmul loop,
    plain and share+priority, against the service alone: its requests come further apart
    than its launches refresh its record; its heartbeat keeps it on the board between them, so
    the best-effort loop keeps its queue short.
--hook-cost instead: the service bare and under each hook mode, taking turns.
Tables 1-5 run in about 7 minutes (table 6: 1). Tables 4 and 6 live in priority.py, what
the tables share in bench_common.py.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench_common import (HERE, START_DELAY, Bench, Busy, CliAt, Report, bins_mean, first_reach,
                          fmt, library, pct, window_rate)
from priority import HOOK_COST_VARIANTS, hook_cost, table4, table6

def parse():
    p = argparse.ArgumentParser()
    p.add_argument("libdir")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--tables", default="1,2,3,4,5",
                   help="which tables, e.g. 3,4 (6, the sparse service, only when named)")
    p.add_argument("--hook-cost", action="store_true",
                   help="only the service bare and under each hook mode, in turns (no tables)")
    p.add_argument("--no-plain-reference", dest="plain_reference", action="store_false",
                   help="table 3 without the four under plain time-slicing")
    return p.parse_args()


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
    if 6 in tables:
        table6(b, say)
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


def four_phase_ok(got, dev, busy, shares, margin=0.5):
    """Table 3's verdict on one phase: the device at least 95% busy (NVML, percent; None:
    unknown, a failure) and each busy tenant (indices `busy`) with at least its share of the
    busy tenants' time (its guarantee plus what an idle one lends, in proportion to the
    guarantees), less `margin` points. `got`: each tenant's rate."""
    due = sum(shares[i] for i in busy)
    total = sum(got)
    return (dev is not None and dev >= 95 and total > 0
            and all(100 * got[i] / total >= 100 * shares[i] / due - margin for i in busy))


def guarantees_held(part, dev, busy, shares, margin=0.5):
    """The issue's reading of a table 3 phase: the device at least 95% busy (NVML, percent;
    None: a failure) and each busy tenant (indices `busy`) with at least its guarantee of the
    device's time (`part`, percent), less `margin` points. With all four busy that is
    [`four_phase_ok`]; with one idle, what it lends is on top."""
    return dev is not None and dev >= 95 and all(part[i] >= shares[i] - margin for i in busy)


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
    # Each tenant's own record, read through its file while all four are busy.
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
    if seen:
        b.raw["four (vgpu status)"] = seen
        say(f"`vgpu status --json` 1 s in, all four busy: {status_line(seen[0][2])}\n")
    say("| phase | " + " | ".join(f"{s}% (% of alone / part of busy)" for s in shares)
        + " | sum % of alone | device busy (NVML) | each its guarantee | lent in proportion (±0.5) |")
    say("|---|" + "---|" * (len(shares) + 4))
    if all(rs):
        alone = window_rate(rs[3], 10.25, 12)
        for phase in range(5):
            t0, t1 = 2 * phase + 0.25, 2 * phase + 2
            got = [window_rate(r, t0, t1) for r in rs]
            busy = [i for i in range(4) if phase != i + 1]
            dev = busy_by_phase(t0, t1)
            part = [100 * g / sum(got) * (dev or 100) / 100 for g in got]
            held = guarantees_held(part, dev, busy, shares)
            ok = four_phase_ok(got, dev, busy, shares)
            name = "all busy" if phase == 0 else f"{shares[phase - 1]}% idle"
            cells = [f"{100 * g / alone:.1f} / {p:.1f}" for g, p in zip(got, part)]
            say(f"| {name} | " + " | ".join(cells) + f" | {sum(100 * g / alone for g in got):.1f} | "
                f"{fmt(dev)} | {'PASS' if held else 'FAIL'} | {'PASS' if ok else 'FAIL'} |")
        say(f"| 40% alone (reference) | | | | 100 | | {fmt(busy_by_phase(10.25, 12))} | | |")
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


def settle_time(a, b, bin_s, at, expect, span=3.0, tol=0.03, window=0.4):
    """Seconds after `at` until the first tenant's part of the pair (launch counts `a`, `b`
    per bin), over the last `window` s, is within `tol` of `expect` and stays so until
    `at + span`; None if it never does. The window is long enough for launch counts to
    stand for parts: a tenant's launches are admitted a queue's depth at a time, and a 50 ms
    bin of host stamps gains or loses one such burst; a 10% tenant of 0.2 ms matmuls makes
    about 25 launches a bin, 200 in 400 ms, where a burst moves its part by far less than
    the 3-point tolerance."""
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
