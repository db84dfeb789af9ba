"""The priority tables of the share-mode bench (elastic.py runs them): 4, a batch-1
inference service beside a best-effort loop in one timeline of alternating slots, after the
hook's own cost to that service (the service bare and hooked in turns); 6, a sparse service
(a request every 0.7 s) beside a matmul loop. Their figures and verdicts are functions of the
tenants' results, tested without a GPU in test_bench_helpers.py.
"""
import time

from bench_common import START_DELAY, fmt, idle_args, quantile, window_rate

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
    # Each hooked one on a board of its own (Bench.env's default): alone there, as a tenant
    # alone on a GPU.
    envs = [b.env("plain")] + [b.env(mode, **kw) for _, mode, kw in variants]
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


# Table 6: a service whose requests come further apart than its launches refresh its
# record (300 ms): its heartbeat thread keeps it on the board between them (and
# `ShareRules::rank_memory` would for 10 s).
SPARSE_THINK_S = 0.7
SPARSE_S = 14.0


def sparse_line(mode, r, alone):
    """Table 6's row: the sparse service's median and worst request (after the first two)
    beside the matmul loop, against the same service alone (`alone`: its result)."""
    if not (r and alone and len(r.get("lat", [])) > 3 and len(alone.get("lat", [])) > 3):
        return f"| {mode} | failed | | | |"
    lat, ref = sorted(r["lat"][2:]), sorted(alone["lat"][2:])
    med, ref_med = lat[len(lat) // 2], ref[len(ref) // 2]
    return (f"| {mode} | {len(lat)} | {med:.2f} / {lat[-1]:.2f} | {med / ref_med:.2f}, "
            f"{lat[-1] / ref_med:.2f} | {med - ref_med:+.2f} |")


def table6(b, say):
    say(f"\n## 6. A sparse service (batch-1 inference, a request every {SPARSE_THINK_S:g} s) beside a matmul loop\n")
    say("Its requests come further apart than its launches refresh its record (300 ms): the "
        "best-effort loop must keep its queue short (the service's heartbeat keeps it on the "
        "board; `ShareRules::rank_memory` would for 10 s). Requests after "
        "the first two; against the same service alone (hooked, share mode, priority 0) run "
        "just before.\n")
    start = time.time() + START_DELAY
    think = ["--think", f"{SPARSE_THINK_S:g}", "--stamps"]
    (alone,) = b.together("sparse alone", [
        (b.env("share", priority=0, turns=b.turns()), b.load("infer", SPARSE_S, start, *think))])
    say("| mode | requests | p50 / worst ms | p50, worst / alone p50 | p50 − alone p50, ms |")
    say("|---|---|---|---|---|")
    if alone:
        ref = sorted(alone["lat"][2:])
        say(f"| alone | {len(ref)} | {ref[len(ref) // 2]:.2f} / {ref[-1]:.2f} | 1.00 | |")
    for mode in ("plain", "share"):
        t = b.turns()
        start = time.time() + START_DELAY
        prio = (0, 1) if mode == "share" else (None, None)
        ri, _ = b.together(f"sparse {mode}", [
            (b.env(mode, priority=prio[0], turns=t), b.load("infer", SPARSE_S, start, *think)),
            (b.env(mode, priority=prio[1], turns=t), b.load("matmul", SPARSE_S, start)),
        ])
        say(sparse_line("plain" if mode == "plain" else "share, priority 0/1", ri, alone))
