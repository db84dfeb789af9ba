"""Share mode's tuning on a real GPU: the priority pair and four busy tenants under
variants of the share-mode knobs, in one run, with each tenant's limiter stats.

usage: python3 gpu-tests/sm_limit/elastic_sweep.py <dir-with-libvgpu.so> [--out DIR] [--only priority|four]

What elastic.py asks (the issue's tables) needs defaults; this finds them. Each variant is
a set of environment variables (VGPU_SHARE_GRACE_US, VGPU_SHARE_OUTRANKED_QUEUE_US,
VGPU_SHARE_GAP_FILL_US, VGPU_WAKE_SLACK_US, VGPU_TURN_LEAD_US, VGPU_TURN_CYCLE_MS) added
to every hooked tenant. Writes DIR/sweep.md (tables) and DIR/sweep.log (each hooked
tenant's exit line "limiter stats: ...", LIBCUDA_LOG_LEVEL=3). About 5 minutes.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic  # noqa: E402  (the tenants and their environments)

START = 7.0  # torch import and CUDA start-up of up to four tenants

PRIORITY = [
    ("plain", None),
    ("defaults (gap fill 125, grace 500, queue 500)", {}),
    ("no gap fill", {"VGPU_SHARE_GAP_FILL_US": "0"}),
    ("gap fill 60", {"VGPU_SHARE_GAP_FILL_US": "60"}),
    ("gap fill 250", {"VGPU_SHARE_GAP_FILL_US": "250"}),
    ("outranked queue 250", {"VGPU_SHARE_OUTRANKED_QUEUE_US": "250"}),
    ("outranked queue 2000", {"VGPU_SHARE_OUTRANKED_QUEUE_US": "2000"}),
    ("grace 250", {"VGPU_SHARE_GRACE_US": "250"}),
]

FOUR = [
    ("plain", "plain", (10, 20, 30, 40), {}),
    ("share defaults", "share", (10, 20, 30, 40), {}),
    ("share, slack 0", "share", (10, 20, 30, 40), {"VGPU_WAKE_SLACK_US": "0"}),
    ("share, lead 200", "share", (10, 20, 30, 40), {"VGPU_TURN_LEAD_US": "200"}),
    ("share, slack 0, lead 200", "share", (10, 20, 30, 40), {"VGPU_WAKE_SLACK_US": "0", "VGPU_TURN_LEAD_US": "200"}),
    ("share, slack 0, lead 200, cycle 40", "share", (10, 20, 30, 40),
     {"VGPU_WAKE_SLACK_US": "0", "VGPU_TURN_LEAD_US": "200", "VGPU_TURN_CYCLE_MS": "40"}),
    ("cap defaults", "cap", (10, 20, 30, 40), {}),
    ("three share defaults", "share", (20, 30, 40), {}),
    ("three share, slack 0, lead 200", "share", (20, 30, 40), {"VGPU_WAKE_SLACK_US": "0", "VGPU_TURN_LEAD_US": "200"}),
]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("libdir")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--only", choices=["priority", "four"])
    return p.parse_args()


class Sweep(elastic.Bench):
    """elastic.Bench with the variant's knobs on every hooked tenant, and a log of each
    tenant's limiter counters (elastic.Bench keeps them; LIBCUDA_LOG_LEVEL=3)."""

    def __init__(self, lib, work, log):
        super().__init__(lib, work)
        self.log = log

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


def main():
    args = parse()
    lib = elastic.library(args.libdir)
    say = elastic.Report(os.path.join(args.out, "sweep.md"))
    log = open(os.path.join(args.out, "sweep.log"), "w")
    b = Sweep(lib, tempfile.mkdtemp(prefix="vgpu-sweep-"), log)

    t0 = time.time()
    say(f"# Share-mode sweep, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.only != "four":
        say("\n## Priority: batch-1 inference (p0) beside training (p1), 6 s each\n")
        s = time.time() + START
        (inf,) = b.run("infer alone", [(b.env("plain"), b.load("infer", 6, s))])
        s = time.time() + START
        (tr,) = b.run("train alone", [(b.env("plain"), b.load("train", 6, s))])
        say(f"alone: p50 {inf['p50_ms']:.2f} ms, p99 {inf['p99_ms']:.2f} ms; training {tr['rate']:.2f} steps/s\n")
        s = time.time() + START
        (hi,) = b.run("infer alone hooked", [(b.env("share", priority=0, turns=b.turns()), b.load("infer", 6, s))])
        s = time.time() + START
        (ht,) = b.run("train alone hooked", [(b.env("share", priority=1, turns=b.turns()), b.load("train", 6, s))])
        t = b.turns()
        s = time.time() + START
        idle_p0, ho = b.run("train beside an idle p0", [
            (b.env("share", priority=0, turns=t), b.load("infer", 6, s, "--think", "1.0")),
            (b.env("share", priority=1, turns=t), b.load("train", 6, s)),
        ])
        say("| hooked alone | p50 / alone | p99 / alone | training % |")
        say("|---|---|---|---|")
        if hi:
            say(f"| infer, share p0 | {hi['p50_ms'] / inf['p50_ms']:.2f} | {hi['p99_ms'] / inf['p99_ms']:.2f} | |")
        if ht:
            say(f"| train, share p1 | | | {100 * ht['rate'] / tr['rate']:.1f} |")
        if ho:
            say(f"| train, share p1, an idle p0 on the board | | | {100 * ho['rate'] / tr['rate']:.1f} |")
        say("\n| variant | p50 / alone | p99 / alone | p50, p99 ms | training % of alone |")
        say("|---|---|---|---|---|")
        for name, extra in PRIORITY:
            t = b.turns()
            s = time.time() + START
            mode = "plain" if extra is None else "share"
            ri, rt = b.run(f"priority {name}", [
                (b.env(mode, priority=0, turns=t, extra=extra), b.load("infer", 6, s)),
                (b.env(mode, priority=1, turns=t, extra=extra), b.load("train", 6, s)),
            ])
            if ri and rt:
                say(f"| {name} | {ri['p50_ms'] / inf['p50_ms']:.2f} | {ri['p99_ms'] / inf['p99_ms']:.2f} | "
                    f"{ri['p50_ms']:.2f}, {ri['p99_ms']:.2f} | {100 * rt['rate'] / tr['rate']:.1f} |")
            else:
                say(f"| {name} | failed | | | |")
    if args.only != "priority":
        s = time.time() + START
        (mm,) = b.run("matmul alone", [(b.env("plain"), b.load("matmul", 3, s))])
        say("\n## Four (or three) busy matmul tenants, 4 s, % of one alone (phase 0.5-4 s)\n")
        say("| variant | shares | each | sum |")
        say("|---|---|---|---|")
        for name, mode, shares, extra in FOUR:
            t = b.turns()
            s = time.time() + START
            rs = b.run(f"four {name}", [
                (b.env(mode, sm=sh, turns=t, extra=extra), b.load("matmul", 4, s)) for sh in shares
            ])
            if all(rs) and mm:
                got = [100 * elastic.window_rate(r, 0.5) / mm["rate"] for r in rs]
                say(f"| {name} | {'/'.join(map(str, shares))} | {' / '.join(f'{g:.1f}' for g in got)} | {sum(got):.1f} |")
            else:
                say(f"| {name} | failed | | |")
    say(f"\nruntime {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
