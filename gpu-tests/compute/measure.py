"""The compute bench's measurements and figures: NVML sampled beside the tenants (device busy
time, per-process SM utilization), the window means, the per-round percentages, the medians
across rounds and the markdown tables. Everything but NvmlBackend runs without a GPU.
"""
import statistics
import threading
import time

from scenarios import ALONE

SAMPLE_S = 0.1


class NvmlBackend:
    """NVML through nvidia-ml-py (pynvml), in the runner: no hook is preloaded here."""

    def __init__(self, index=0):
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)

    def info(self):
        nv, h = self.nv, self.h
        out = {}
        for key, fn in (("name", lambda: nv.nvmlDeviceGetName(h)),
                        ("driver", nv.nvmlSystemGetDriverVersion),
                        ("sm_clock_max_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
                        ("power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000)):
            try:
                v = fn()
                out[key] = v.decode() if isinstance(v, bytes) else v
            except Exception as e:  # noqa: BLE001 - informational only
                out[key] = f"unavailable ({e})"
        return out

    def device_util(self):
        return float(self.nv.nvmlDeviceGetUtilizationRates(self.h).gpu)

    def process_samples(self, since_us):
        """[(pid, timestamp µs, smUtil)] newer than `since_us` ([] when NVML has none)."""
        try:
            got = self.nv.nvmlDeviceGetProcessUtilization(self.h, since_us)
        except self.nv.NVMLError:
            return []
        return [(int(s.pid), int(s.timeStamp), float(s.smUtil)) for s in got]

    def compute_pids(self):
        return {int(p.pid) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)}


class NoNvml:
    """No NVML (nvidia-ml-py missing or failing): every reading fails, the sampler notes it."""

    def __init__(self, why):
        self.why = why

    def info(self):
        return {"name": f"unknown (no NVML: {self.why})"}

    def device_util(self):
        raise RuntimeError(self.why)

    def process_samples(self, since_us):
        raise RuntimeError(self.why)

    def compute_pids(self):
        raise RuntimeError(self.why)


class FakeNvml:
    """NVML without a GPU (--fake, tests): the device busy at `busy` % while any of `pids()`
    (a callable: the tenants with a context) lives, split evenly between them."""

    def __init__(self, pids, busy=90.0):
        self.pids, self.busy = pids, busy

    def info(self):
        return {"name": "fake"}

    def device_util(self):
        return self.busy if self.pids() else 0.0

    def process_samples(self, since_us):
        live = sorted(self.pids())
        now = int(time.time() * 1e6)
        return [(p, now, self.busy / len(live)) for p in live] if now > since_us else []

    def compute_pids(self):
        return set(self.pids())


class Sampler:
    """Samples `backend` every SAMPLE_S in a thread: the device's utilization (with the wall
    time of each reading) and every per-process sample NVML gives (deduplicated)."""

    def __init__(self, backend):
        self.backend = backend
        self.dev = []  # (wall s, percent)
        self.proc = {}  # (pid, ts µs) -> smUtil
        self.errors = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.last_us = 0

    def start(self):
        self.thread.start()
        return self

    def loop(self):
        while not self.stop_event.is_set():
            self.sample_once()
            self.stop_event.wait(SAMPLE_S)

    def sample_once(self):
        try:
            util = self.backend.device_util()
            samples = self.backend.process_samples(self.last_us)
        except Exception as e:  # noqa: BLE001 - a sampler error must not end the bench
            if len(self.errors) < 20:
                self.errors.append(f"{time.time():.1f}: {type(e).__name__}: {e}")
            return
        with self.lock:
            self.dev.append((time.time(), util))
            for pid, ts, sm in samples:
                self.proc[(pid, ts)] = sm
                self.last_us = max(self.last_us, ts)

    def stop(self):
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def device_mean(self, t0, t1):
        with self.lock:
            return device_mean(self.dev, t0, t1)

    def process_mean(self, pid, t0, t1):
        with self.lock:
            return process_mean(self.proc, pid, t0, t1)


# ---- window arithmetic -------------------------------------------------------------------

def device_mean(samples, t0, t1):
    """Mean device utilization (%) of the readings taken in [t0, t1] (None without one)."""
    v = [u for t, u in samples if t0 <= t <= t1]
    return statistics.mean(v) if v else None


def process_mean(proc, pid, t0, t1):
    """(mean smUtil %, sample count) of `pid`'s NVML samples stamped in [t0, t1] seconds
    ((None, 0) without one). NVML gives a process a sample only for periods it ran in and
    few samples per second (4-7 in 4 s on the H200), so this is a cross-check, not a meter."""
    v = [sm for (p, ts), sm in proc.items() if p == pid and t0 <= ts / 1e6 <= t1]
    return (statistics.mean(v) if v else None), len(v)


def pct(x, base):
    return None if x is None or not base else 100.0 * x / base


def median(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


# ---- figures per round and across rounds ---------------------------------------------------

def alone_refs(runs):
    """{(round, workload): the tenant record of its alone run} for successful alone runs."""
    out = {}
    for run in runs:
        if run["mode"] == ALONE and run["tenants"] and run["tenants"][0]["result"].get("ok"):
            # The tenant's record with its run's device busy time (the (a) share's factor).
            rec = run["tenants"][0]
            out[(run["round"], rec["workload"])] = dict(rec, device_util=run.get("device_util"))
    return out


def tenant_figures(rec, alone, plain=None):
    """One tenant's figures in one round: throughput as % of its alone run, its GPU time share
    two ways ((a) throughput % × the alone run's device busy fraction, (b) NVML's per-process
    mean), and for a service its latencies and their ratios to alone and to plain (`plain`:
    its record in the plain run of the same round). Missing inputs give None."""
    r = rec["result"]
    ok = r.get("ok")
    ref = alone["result"] if alone else {}
    thr = pct(r.get("rate"), ref.get("rate")) if ok and ref.get("ok") else None
    busy = alone.get("device_util") if alone else None
    f = {"thr_pct": thr, "rate": r.get("rate") if ok else None,
         "share_a": None if thr is None or busy is None else thr * busy / 100.0,
         "share_b": rec.get("nvml_util"), "nvml_samples": rec.get("nvml_samples", 0),
         "alone_busy": busy, "ok": bool(ok), "service": "p50_ms" in r}
    if "p50_ms" in r and ok:
        f.update(p50_ms=r["p50_ms"], p99_ms=r["p99_ms"], late=r.get("late"), unserved=r.get("unserved"))
        for name, base in (("alone", ref if ref.get("ok") else None),
                           ("plain", plain["result"] if plain and plain["result"].get("ok") else None)):
            for q in ("p50", "p99"):
                b = base.get(f"{q}_ms") if base else None
                f[f"{q}_vs_{name}"] = r[f"{q}_ms"] / b if b else None
    return f


def round_figures(runs):
    """{(scenario, mode): {round: {"tenants": [figures per tenant], "device_util", "sum_thr"}}}
    for every scenario run, each against the same round's alone runs; alone rows come from
    the alone runs of the scenario's workloads."""
    refs = alone_refs(runs)
    plain = {(run["round"], run["scenario"]): run for run in runs if run["mode"] == "plain"}
    out = {}
    for run in runs:
        if run["mode"] == ALONE:
            continue
        p = plain.get((run["round"], run["scenario"]))
        figs = []
        for i, rec in enumerate(run["tenants"]):
            alone = refs.get((run["round"], rec["workload"]))
            figs.append(tenant_figures(rec, alone, p["tenants"][i] if p else None))
        thr = [f["thr_pct"] for f in figs if not f.get("service")]
        out.setdefault((run["scenario"], run["mode"]), {})[run["round"]] = {
            "tenants": figs, "device_util": run.get("device_util"),
            "sum_thr": sum(thr) if thr and all(x is not None for x in thr) else None}
    # Alone rows: each workload's own alone run, per round.
    for (scenario, _mode), by_round in list(out.items()):
        for rnd in by_round:
            key = (scenario, ALONE)
            if rnd in out.get(key, {}):
                continue
            n = len(by_round[rnd]["tenants"])
            scen_run = next(r for r in runs if r["scenario"] == scenario and r["round"] == rnd)
            figs = []
            for i in range(n):
                alone = refs.get((rnd, scen_run["tenants"][i]["workload"]))
                figs.append(tenant_figures(alone, alone) if alone else {"ok": False})
            out.setdefault(key, {})[rnd] = {"tenants": figs, "device_util": None, "sum_thr": None}
    return out


FIELDS = ("thr_pct", "rate", "share_a", "share_b", "nvml_samples", "alone_busy", "p50_ms", "p99_ms",
          "p50_vs_alone", "p99_vs_alone", "p50_vs_plain", "p99_vs_plain", "late", "unserved")


def medians(by_round):
    """The medians across rounds of each tenant's figures, the device's utilization and the
    sum of throughputs, with the per-round values kept (`rounds`)."""
    rounds = sorted(by_round)
    n = max(len(by_round[r]["tenants"]) for r in rounds)
    tenants = []
    for i in range(n):
        per = [by_round[r]["tenants"][i] for r in rounds if i < len(by_round[r]["tenants"])]
        t = {k: median([p.get(k) for p in per]) for k in FIELDS}
        t["ok_rounds"] = sum(1 for p in per if p.get("ok"))
        tenants.append(t)
    return {"rounds": rounds, "tenants": tenants,
            "device_util": median([by_round[r]["device_util"] for r in rounds]),
            "sum_thr": median([by_round[r]["sum_thr"] for r in rounds])}


def summarize(runs, scenarios):
    """{scenario: {mode: medians}} in the scenarios' mode order, for the tables and the JSON."""
    figs = round_figures(runs)
    out = {}
    for s in scenarios:
        rows = {}
        for mode in s.modes:
            if (s.name, mode) in figs:
                rows[mode] = medians(figs[(s.name, mode)])
                rows[mode]["per_round"] = figs[(s.name, mode)]
        if rows:
            out[s.name] = rows
    return out


# ---- tables -------------------------------------------------------------------------------

def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def table(s, rows):
    """A scenario's markdown table: rows = modes, per tenant its throughput % of alone, GPU
    share (a) and (b) (NVML sample count), or for a service p50/p99 and their ratios."""
    head = ["mode"]
    for t in s.tenants:
        if t.service:
            head += [f"{t.label}: p50 / p99 ms", "× alone", "× plain", "NVML %"]
        else:
            head += [f"{t.label}: thr % alone", "GPU % (a)", "NVML % (b)"]
    head += ["best-effort thr %" if any(t.service for t in s.tenants) else "sum thr %",
             "device util %", "rounds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, m in rows.items():
        cells = [mode]
        for t, f in zip(s.tenants, m["tenants"]):
            if f.get("ok_rounds", 0) == 0:
                cells += ["failed"] + [""] * (3 if t.service else 2)
            elif t.service:
                # "≥": requests left unserved at the window's end count with their wait so far.
                at_least = "≥" if f.get("unserved") else ""
                cells += [f"{fmt(f['p50_ms'], '.2f')} / {at_least}{fmt(f['p99_ms'], '.2f')}",
                          f"{fmt(f['p50_vs_alone'], '.2f')} / {fmt(f['p99_vs_alone'], '.2f')}",
                          "" if mode in (ALONE, "plain") else
                          f"{fmt(f['p50_vs_plain'], '.2f')} / {fmt(f['p99_vs_plain'], '.2f')}",
                          f"{fmt(f['share_b'])} ({fmt(f['nvml_samples'], '.0f')})"]
            else:
                thr = fmt(f["thr_pct"]) + (f" ({fmt(f['rate'], '.1f')}/s)" if mode == ALONE else "")
                cells += [thr, fmt(f["share_a"]), f"{fmt(f['share_b'])} ({fmt(f['nvml_samples'], '.0f')})"]
        cells += [fmt(m["sum_thr"]), fmt(m["device_util"]), str(len(m["rounds"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cap_ideal(s, rows):
    """The sum of thr % a scenario's tenants would make at exactly min(their cap, their alone
    GPU %): what cap mode can give at best if sharing cost the GPU nothing (plain time slicing
    is not held to the caps, so it can be above it). None where a tenant is a service, has no
    cap, or has no alone figure."""
    alone = rows.get(ALONE)
    if alone is None or any(t.service or t.sm is None for t in s.tenants):
        return None
    total = 0.0
    for t, f in zip(s.tenants, alone["tenants"]):
        busy = f.get("share_a")
        if not busy:
            return None
        total += min(100.0, 100.0 * t.sm / busy)
    return total


LEGEND = ("Medians over rounds; each round's figures against the same round's alone runs (no "
          "hook, nothing else on the GPU). thr % alone: steps (or requests) per second as a "
          "percentage of alone (alone rows: 100 and the rate). GPU % (a): thr % × the alone "
          "run's device busy time (NVML utilization.gpu); NVML % (b): NVML's per-process SM "
          "utilization over the tenant's window (samples in brackets; few, so a cross-check). "
          "Services: latency from each request's scheduled arrival, and its ratios (p50 / p99) "
          "to alone and to plain in the same round; ≥ where requests were still waiting at the "
          "window's end (counted with their wait so far). device util %: NVML utilization.gpu over "
          "the window.")


def report(summary, scenarios, meta):
    """The markdown report: a heading and a table per scenario, the legend, what was skipped."""
    out = ["# Compute bench", "", f"{meta.get('date', '')}; device: {meta.get('device', {}).get('name', '?')}; "
           f"window {meta.get('seconds')} s; rounds planned {meta.get('rounds')}", "", LEGEND, ""]
    for s in scenarios:
        if s.name not in summary:
            continue
        limits = ", ".join(t.label for t in s.tenants)
        out += [f"## {s.name}: {s.about}", "", f"Tenants: {limits}.", ""]
        out += table(s, summary[s.name])
        ideal = cap_ideal(s, summary[s.name])
        if ideal is not None and ({"vgpu-cap", "hami"} & set(summary[s.name])):
            out += ["", f"cap-ideal sum thr %: {ideal:.1f} (each tenant at exactly min(its cap, "
                        "its alone GPU %): cap mode's best if sharing cost the GPU nothing)"]
        out.append("")
    if meta.get("skipped"):
        out += ["## Not run", ""] + [f"- {x}" for x in meta["skipped"]] + [""]
    if meta.get("warnings"):
        out += ["## Warnings", ""] + [f"- {x}" for x in meta["warnings"]] + [""]
    if meta.get("failures"):
        out += ["## Failures", ""] + [f"- {x}" for x in meta["failures"]] + [""]
    return "\n".join(out) + "\n"
