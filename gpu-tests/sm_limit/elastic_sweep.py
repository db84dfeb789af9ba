"""Share mode's tuning on a real GPU: the priority pair and four busy tenants under
variants of the share-mode knobs, in one run, with each tenant's limiter stats.

usage: python3 gpu-tests/sm_limit/elastic_sweep.py <dir-with-libvgpu.so> [--out DIR] [--only priority|four]

What elastic.py asks (the issue's tables) needs defaults; this finds them. Each variant is
a set of environment variables (VGPU_SHARE_GRACE_US, VGPU_SHARE_OUTRANKED_QUEUE_US,
VGPU_SHARE_GAP_FILL_US, VGPU_WAKE_SLACK_US, VGPU_TURN_LEAD_US, VGPU_TURN_CYCLE_MS) added
to every hooked tenant. Writes DIR/sweep.md (tables), DIR/sweep.json (raw) and DIR/sweep.log (each hooked
tenant's exit line "limiter stats: ...", LIBCUDA_LOG_LEVEL=3). About 4 minutes for
the priority pair (table 4's 24 s timeline per variant), 2 for the four.
"""
import argparse
import io
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402  (the tenants and their environments)
import elastic  # noqa: E402  (table 3's window order)
import priority  # noqa: E402  (table 4's timeline and figures)

START = 7.0  # torch import and CUDA start-up of up to four tenants

PRIORITY = [
    ("plain", None),
    ("defaults (gap fill 125, grace 500, queue 500)", {}),
    ("defaults again", {}),
    ("no gap fill", {"VGPU_SHARE_GAP_FILL_US": "0"}),
    ("gap fill 60", {"VGPU_SHARE_GAP_FILL_US": "60"}),
    ("outranked queue 2000", {"VGPU_SHARE_OUTRANKED_QUEUE_US": "2000"}),
    ("grace 250", {"VGPU_SHARE_GRACE_US": "250"}),
]

FOUR = [
    ("plain", "plain", (10, 20, 30, 40), {}),
    # Repeats: the windows' order (by key) differs from run to run, so that a loss that
    # follows a window's place can be told from one that follows its size.
    ("share defaults", "share", (10, 20, 30, 40), {}),
    ("share defaults, again", "share", (10, 20, 30, 40), {}),
    ("share defaults, a third time", "share", (10, 20, 30, 40), {}),
    ("share defaults, a fourth time", "share", (10, 20, 30, 40), {}),
    ("share, cycle 80", "share", (10, 20, 30, 40), {"VGPU_TURN_CYCLE_MS": "80"}),
    ("share, cycle 80, again", "share", (10, 20, 30, 40), {"VGPU_TURN_CYCLE_MS": "80"}),
    ("share, cycle 160", "share", (10, 20, 30, 40), {"VGPU_TURN_CYCLE_MS": "160"}),
]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("libdir")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--only", choices=["priority", "four"])
    return p.parse_args()


class Sweep(bench_common.Bench):
    """bench_common.Bench with the variant's knobs on every hooked tenant, and a log of each
    tenant's limiter counters (bench_common.Bench keeps them; LIBCUDA_LOG_LEVEL=3)."""

    def __init__(self, lib, work, log=None):
        super().__init__(lib, work)
        self.log = log or io.StringIO()

    def env(self, mode, sm=None, priority=None, turns=None, extra=None):
        e = super().env(mode, sm=sm, priority=priority, turns=turns)
        if mode != "plain":
            e.update(extra or {})
        return e

    def run(self, label, tenants):
        out = self.together(label, tenants)
        for i, stats in enumerate(self.raw[label + " (limiter stats)"]):
            self.log.write(f"[{label}] tenant {i}: " + (" | ".join(stats) or "(no stats)") + "\n")
        self.log.flush()
        return out


def priority_variants(b, say):
    """Batch-1 inference (priority 0) beside training (priority 1) in table 4's timeline of
    alternating slots, once per variant, each against itself alone in the same timeline."""
    seconds, counted, service_idle, other_idle = priority.priority_schedule()
    say(f"\n## Priority: batch-1 inference (p0) beside training (p1), table 4's {seconds:g} s "
        f"timeline per variant\n")
    s = time.time() + START
    (inf,) = b.run("infer alone", [(b.env("plain"), b.load("infer", 8, s))])
    say("| variant | p50 ms alone / both | p99 ms alone / both | p50 both / alone | p99 both / alone "
        "| p50, p99 both / plain both | p50 both / bare | training both, % of alone | verdict |")
    say("|---|---|---|---|---|---|---|---|---|")
    plain, medians = None, []
    for name, extra in PRIORITY:
        t = b.turns()
        s = time.time() + START
        mode = "plain" if extra is None else "share"
        ri, rt = b.run(f"priority {name}", [
            (b.env(mode, priority=0, turns=t, extra=extra),
             b.load("infer", seconds, s, *bench_common.idle_args(service_idle), "--stamps")),
            (b.env(mode, priority=1, turns=t, extra=extra),
             b.load("train", seconds, s, *bench_common.idle_args(other_idle), "--stamps")),
        ])
        say(priority.priority_line(name, ri, rt, inf, plain, counted))
        if ri and rt:
            medians.append((name, priority.slot_medians(ri, counted) + priority.gpu_wait(ri, counted)))
            if mode == "plain":
                plain = priority.priority_figures(ri, rt, counted)
    say(f"\n{priority.SLOT_MEDIANS_LEGEND}\n")
    for name, m in medians:
        say(f"- {name}: {m}")


def four_variants(b, say, vgpu, mm):
    """Four matmul tenants at 10/20/30/40, busy 6 s, once per variant of FOUR: each one's
    rate against one alone (`mm`), its part of what the four got, and the windows' order."""
    say("\n## Four busy matmul tenants, 6 s, from 0.5 s on: % of one alone; part of what "
        "the four got (each one's rate over the sum); the windows in cycle order at 2 s\n")
    say("| variant | shares | % of alone | sum | part of the four's | windows in order |")
    say("|---|---|---|---|---|---|")
    for name, mode, shares, extra in FOUR:
        t = b.turns()
        s = time.time() + START
        envs = [b.env(mode, sm=sh, turns=t, extra=extra) for sh in shares]
        cli = None
        if mode != "plain":
            cli = bench_common.CliAt(vgpu, s, [
                (2.0, ["status", "--json", "--cache", e["CUDA_DEVICE_MEMORY_SHARED_CACHE"]])
                for e in envs], env={"VGPU_TURN_DIR": t})
        rs = b.run(f"four {name}", [(e, b.load("matmul", 6, s)) for e in envs])
        seen = cli.join() if cli else None
        order = elastic.window_order(seen, shares) if seen else ""
        if seen:
            b.raw[f"four {name} (vgpu status)"] = seen
        if all(rs) and mm:
            got = [100 * bench_common.window_rate(r, 0.5) / mm["rate"] for r in rs]
            parts = [100 * g / sum(got) for g in got]
            say(f"| {name} | {'/'.join(map(str, shares))} | {' / '.join(f'{g:.1f}' for g in got)} "
                f"| {sum(got):.1f} | {' / '.join(f'{x:.2f}' for x in parts)} | {order} |")
        else:
            say(f"| {name} | failed | | | | |")


def main():
    args = parse()
    lib = bench_common.library(args.libdir)
    say = bench_common.Report(os.path.join(args.out, "sweep.md"))
    log = open(os.path.join(args.out, "sweep.log"), "w")
    b = Sweep(lib, tempfile.mkdtemp(prefix="vgpu-sweep-"), log)

    t0 = time.time()
    say(f"# Share-mode sweep, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.only != "four":
        priority_variants(b, say)
    if args.only != "priority":
        s = time.time() + START
        (mm,) = b.run("matmul alone", [(b.env("plain"), b.load("matmul", 3, s))])
        four_variants(b, say, os.path.join(os.path.dirname(lib), "vgpu"), mm)
    say(f"\nruntime {time.time() - t0:.0f} s")
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(b.raw, f)


if __name__ == "__main__":
    main()
