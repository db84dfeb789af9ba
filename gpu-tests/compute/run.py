"""Compute sharing on real workloads (issue 25): pairs and quartets of training loops, inference
services and synthetic loops, each scenario under every mode in the same run, in alternating
rounds.

On the device, one call (HAMi-core built from .carry/hami-core, then the core set: 2 rounds of
5 s windows in about 8 minutes; vgpu's libvgpu.so, and its `vgpu` CLI if wanted, copied into
a small ignored directory such as .carry/vgpu-bin, which the call carries with .carry/hami-core):

    bash gpu-tests/compute/run_core.sh .carry/vgpu-bin "$OUT/compute"

or by hand:

    bash gpu-tests/compute/build_hami.sh .carry/hami-core /tmp/hami      # prints the library
    python3 gpu-tests/compute/run.py --vgpu-lib .carry/vgpu-bin/libvgpu.so \\
        --hami-lib /tmp/hami/libvgpu.so [--vgpu .carry/vgpu-bin/vgpu] --out out/compute \\
        [--scenarios core] [--rounds 2] [--seconds 5] [--budget 480] [--plan-only]

Without a GPU (the runner's whole path on sleeping tenants and a fake NVML):

    python3 gpu-tests/compute/run.py --fake --seconds 0.5 --out /tmp/fake-bench

Modes (scenarios.py): alone (each workload by itself, no hook: the reference), plain (together,
no hook: time-slicing), hami (HAMi-core, CUDA_DEVICE_SM_LIMIT, GPU_CORE_UTILIZATION_POLICY=FORCE,
no monitor), vgpu-cap, vgpu-share (VGPU_SM_MODE=share), vgpu-prio (share mode with
CUDA_TASK_PRIORITY), vgpu-nolimit (the hook without an SM limit: the solo rows of caps above
the demand). Each tenant is a container: its own shared file; a scenario's vgpu tenants
share a fresh turn directory per run. A mode whose library is not given is left out (said).

--scenarios: comma-separated names from scenarios.py, `core` (the default: two training pairs
at 30/70, a batch-1 service beside training with priorities, a matmul pair at 30/70, a
training quartet at 10/20/30/40) or `all`. --modes restricts the modes.

Order and time: rounds (--rounds, fewer down to --min-rounds if the budget needs, then
trailing scenarios dropped: the plan says what and why), in each round every scenario with its
modes in an order that turns with the round and the scenario; a workload runs alone once per
round and the round's scenarios share that run. A run's tenants start together; each imports
and builds on the host, then creates its CUDA context when the runner lets it (one at a time:
HAMi-core finds its host pid by NVML's process list around its own context, and so does the
runner for each tenant's NVML pid), warms up, and all time the same window (--seconds) from a
start the runner sets once all are warm. The next run's tenants start while the current one
runs (importing at niceness 10, waiting before their CUDA context; --no-overlap starts them
after it instead), and a run's tenants hand over to the next as soon as they have printed
their results, so imports and teardowns cost time once. --budget (seconds) bounds the whole;
the plan's estimates are rescaled by what the runs so far took, and what no longer fits is
skipped and listed.

Out (--out): compute.md (a table per scenario: rows = modes; per tenant its throughput as % of
alone, its GPU time share (a) thr % × alone busy and (b) NVML per-process, or a service's
p50/p99 and their ratios to alone and plain; the device's utilization; then what was not run,
warnings (a HAMi tenant that found no host pid was not limited) and failures) and compute.json
(the plan, every run's raw tenant results, NVML figures, stderr tails, limiter stats, HAMi's
host-pid detection, `vgpu status` snapshots, the seconds the next run's imports overlapped its
window, and the medians with their per-round values). Both are rewritten after every run, so
a run cut short keeps what it measured. Progress lines carry the time and the seconds since
the start.
"""
import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure  # noqa: E402
import scenarios as sc  # noqa: E402
from tenant import mark_path, write_atomic  # noqa: E402

TENANT = os.path.join(HERE, "tenant.py")
PARK_TIMEOUT_S = 180.0
CTX_TIMEOUT_S = 90.0
WARM_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 60.0  # after the window's end
HARD_GRACE_S = 30.0  # past the budget, the current run is killed and the bench ends
STDERR_TAIL = 3000
# The vgpu tenants' lines kept in the JSON: the limiter's counters, its launch timing (diagnostic
# builds) and, with --log-level 4, its heaviest identities.
LIMITER_LINES = ("limiter stats", "limiter costs", "launch timing", ": identity 0x")
HAMI_PID_FAILED = ("SET_TASK_PID FAILED", "host pid is error", "HOST PID NOT FOUND",
                   "Skipped host PID detection")


class Clock:
    def __init__(self):
        self.t0 = time.time()

    def say(self, msg):
        now = time.time()
        print(f"[{time.strftime('%H:%M:%S', time.localtime(now))} +{now - self.t0:6.1f}s] {msg}", flush=True)

    def elapsed(self):
        return time.time() - self.t0


class Launched:
    """A unit's tenant processes, started (they import, then wait at the gate)."""

    def __init__(self, unit, dirpath, procs, envs, files):
        self.unit, self.dir, self.procs, self.envs, self.files = unit, dirpath, procs, envs, files
        self.started = time.time()

    def alive(self, i):
        return self.procs[i].poll() is None

    def mark(self, name, i):
        return os.path.exists(mark_path(self.dir, name, i))

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the tenant's own session (our child)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def fake_argv(tenant, mode, n, fail):
    """--fake: tenant.py's fake kind in place of the workload, at the rate the mode would give:
    alone all of it, a limited tenant its limit, others an even split; a service's latency
    grows with its neighbours (less under priority)."""
    share = 1.0 if mode == sc.ALONE else (
        tenant.sm / 100.0 if mode in sc.HOOKED and tenant.sm else 1.0 / n)
    argv = ["fake", "--fake-rate", "200", "--fake-share", f"{share:.4f}"]
    if tenant.service:
        lat = 2.0 if mode == sc.ALONE else 2.0 * (1.1 if mode == "vgpu-prio" else 1.0 + 0.5 * (n - 1))
        a = list(tenant.args)
        argv += ["--fake-latency-ms", f"{lat:g}", "--interval-ms", a[a.index("--interval-ms") + 1]]
        if "--poisson" in a:
            argv += ["--poisson", "--seed", a[a.index("--seed") + 1]]
    if fail.get(tenant.workload):
        argv += ["--fake-fail", fail[tenant.workload]]
    return argv


def parse_result(stdout_path, rc):
    try:
        with open(stdout_path, errors="replace") as f:
            lines = [l for l in f.read().splitlines() if l.startswith("RESULT ")]
    except OSError as e:
        return {"ok": False, "error": f"no stdout: {e}"}
    if not lines:
        return {"ok": False, "error": f"no RESULT line (exit {rc})"}
    try:
        return json.loads(lines[-1][len("RESULT "):])
    except ValueError as e:
        return {"ok": False, "error": f"unreadable RESULT: {e}"}


def charged_util(status_text):
    """A container's published SM utilization (percent; its processes' sum) from `vgpu status
    --json` output, or None when the output is not a status with processes."""
    try:
        st = json.loads(status_text)
        procs = st["processes"]
        return float(sum(d.get("sm_utilization_percent", 0) for p in procs for d in p.get("devices", [])))
    except (ValueError, KeyError, TypeError):
        return None


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def has_result(stdout_path):
    return "RESULT " in read(stdout_path)


class Bench:
    def __init__(self, args, units, backend, clock):
        self.args, self.units, self.clock = args, units, clock
        self.say = clock.say
        self.libs = sc.Libraries(vgpu=args.vgpu_lib, hami=args.hami_lib)
        self.work = args.work or tempfile.mkdtemp(prefix="compute-bench-")
        self.ctx_pids = set()  # tenants with a context (FakeNvml's processes)
        self.live = []  # Launched units, for the cleanup
        self.nvml = backend(self) if callable(backend) else backend
        self.sampler = measure.Sampler(self.nvml)
        self.fail = dict(x.split("=", 1) for x in (args.fake_fail or []))
        self.runs = []
        self.pid_list_failed = False
        self.exiting = []  # (Launched, record) whose tenants have printed but may still exit

    def live_ctx_pids(self):
        """Tenants with a context that still run (read by the sampler's thread: copies)."""
        live = {q.pid for l in list(self.live) for q in l.procs if q.poll() is None}
        return set(self.ctx_pids) & live

    # -- starting a unit's tenants ----------------------------------------------------------

    def launch(self, unit, k):
        d = os.path.join(self.work, f"u{k:03d}")
        os.makedirs(d)
        turns = os.path.join(d, "turns")
        os.makedirs(turns)
        procs, envs, files = [], [], []
        for i, t in enumerate(unit.tenants):
            env = sc.tenant_env(os.environ, unit.mode, t, self.libs, os.path.join(d, f"c{i}.cache"), turns,
                                self.args.log_level)
            kind_argv = fake_argv(t, unit.mode, len(unit.tenants), self.fail) if self.args.fake else [t.kind, *t.args]
            if self.args.fake and "LD_PRELOAD" in env:
                env["FAKE_LD_PRELOAD"] = env.pop("LD_PRELOAD")  # nothing to preload into a sleeper
            argv = [sys.executable, TENANT, *kind_argv, "--seconds", f"{self.args.seconds:g}",
                    "--sync", d, "--index", str(i), "--label", t.label]
            out, err = os.path.join(d, f"t{i}.out"), os.path.join(d, f"t{i}.err")
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen(argv, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                              cwd=d, start_new_session=True))
            envs.append(env)
            files.append((out, err, argv))
        launched = Launched(unit, d, procs, envs, files)
        self.live.append(launched)
        return launched

    # -- driving it -------------------------------------------------------------------------

    def wait_marks(self, L, name, indices, timeout):
        """Waits until each tenant of `indices` has written mark `name`, failed or exited;
        returns those that did write it."""
        deadline = min(time.time() + timeout, self.hard_deadline)
        pending = set(indices)
        done = set()
        while pending and time.time() < deadline:
            for i in list(pending):
                if L.mark(name, i):
                    done.add(i)
                    pending.discard(i)
                elif L.mark("fail", i) or not L.alive(i):
                    pending.discard(i)
            if pending:
                time.sleep(0.005)
        if pending:
            self.say(f"  {L.unit.name}: tenants {sorted(pending)} not {name} in time")
        return done

    def drive(self, L):
        unit, n = L.unit, len(L.unit.tenants)
        rec = {"name": unit.name, "round": unit.round, "scenario": unit.scenario, "mode": unit.mode,
               "seconds": self.args.seconds, "dir": L.dir, "warnings": []}
        t_begin = time.time()
        parked = self.wait_marks(L, "parked", range(n), PARK_TIMEOUT_S)
        rec["park_wait_s"] = round(time.time() - t_begin, 3)
        baseline = self.compute_pids()
        seen = set(baseline or ())
        early = [L.procs[i].pid for i in range(n) if L.procs[i].pid in seen]
        if early:
            rec["warnings"].append(f"tenants {early} had a CUDA context before the gate")
        nvml_pids = [None] * n
        for i in sorted(parked):
            write_atomic(mark_path(L.dir, "go", i), "go")
            if self.wait_marks(L, "ctx", [i], CTX_TIMEOUT_S):
                self.ctx_pids.add(L.procs[i].pid)
                now = self.compute_pids()
                if now is None:
                    continue  # no NVML process list: no per-process figures (said once)
                new = now - seen
                seen |= now
                if L.procs[i].pid in now:
                    nvml_pids[i] = L.procs[i].pid
                elif len(new) == 1:
                    nvml_pids[i] = new.pop()
                else:
                    rec["warnings"].append(f"tenant {i}: NVML pid not found (new pids {sorted(new)})")
        warm = self.wait_marks(L, "warm", range(n), WARM_TIMEOUT_S)
        start = time.time() + sc.START_MARGIN_S
        write_atomic(os.path.join(L.dir, "start"), repr(start))
        rec["start"] = start
        rec["setup_s"] = round(start - t_begin, 3)
        self.say(f"  {unit.name}: {len(warm)}/{n} warm after {start - L.started:.1f} s "
                 f"(here {start - t_begin:.1f} s); window {self.args.seconds:g} s")
        status = self.vgpu_status(L, start) if unit.mode.startswith("vgpu") else None
        deadline = min(start + self.args.seconds + EXIT_TIMEOUT_S, self.hard_deadline)
        self.wait_results(L, deadline, rec)
        if status:
            status.join(timeout=15)
        rec["vgpu_status"] = getattr(status, "out", None)
        charged = getattr(status, "charged", None)
        rec["device_util"] = self.sampler.device_mean(start, start + self.args.seconds)
        rec["tenants"] = [self.tenant_record(L, i, nvml_pids[i]) for i in range(n)]
        for i, t in enumerate(rec["tenants"]):
            if charged and charged[i]:
                t["charged_samples"] = charged[i]
                t["charged_util"] = measure.median(charged[i])
        rec["duration_s"] = round(time.time() - t_begin, 3)
        self.exiting.append((L, rec))
        self.reap()
        return rec

    def wait_results(self, L, deadline, rec):
        """Waits until every tenant has printed its RESULT or exited (a tenant's GPU work is
        over once it prints: the next run's contexts need not wait for its teardown); kills
        the run's tenants at `deadline`."""
        pending = set(range(len(L.procs)))
        while pending and time.time() < deadline:
            for i in list(pending):
                if not L.alive(i) or has_result(L.files[i][0]):
                    pending.discard(i)
            if pending:
                time.sleep(0.02)
        if pending:
            rec["warnings"].append(f"tenants {sorted(pending)} killed: no result {EXIT_TIMEOUT_S:g} s "
                                   "after the window (or past the budget)")
            L.kill()

    def reap(self, wait_s=0.0):
        """Completes the records of runs whose tenants have exited (exit code, stderr: the
        limiter prints its counters at exit), waiting up to `wait_s`, then killing the rest."""
        deadline = time.time() + wait_s
        while True:
            for L, rec in list(self.exiting):
                if all(not L.alive(i) for i in range(len(L.procs))):
                    for i, t in enumerate(rec["tenants"]):
                        t.update(self.exit_fields(L, i))
                    self.exiting.remove((L, rec))
                    self.live.remove(L)
                    self.ctx_pids -= {p.pid for p in L.procs}
            if not self.exiting or time.time() >= deadline:
                break
            time.sleep(0.05)
        if wait_s > 0:
            for L, rec in list(self.exiting):
                L.kill()
                rec["warnings"].append("tenants killed: still exiting after their results")
            if self.exiting:
                self.reap()

    def tenant_record(self, L, i, nvml_pid):
        t, p = L.unit.tenants[i], L.procs[i]
        out, _err, argv = L.files[i]
        res = parse_result(out, p.poll())
        rec = {"index": i, "workload": t.workload, "label": t.label, "sm": t.sm, "priority": t.priority,
               "argv": argv[2:], "pid": p.pid, "nvml_pid": nvml_pid,
               "env": {k: v for k, v in L.envs[i].items() if os.environ.get(k) != v}, "result": res}
        rec.update(self.exit_fields(L, i))  # for now; complete once the tenant has exited
        if res.get("ok") and nvml_pid is not None:
            rec["nvml_util"], rec["nvml_samples"] = self.sampler.process_mean(nvml_pid, res["t0"], res["t1"])
        return rec

    @staticmethod
    def exit_fields(L, i):
        """What a tenant leaves on exit: its exit code, its stderr's tail, the limiter's
        counters and, under HAMi-core, whether it found the host pid it limits by."""
        text = read(L.files[i][1])
        out = {"returncode": L.procs[i].poll(), "stderr_tail": text[-STDERR_TAIL:],
               "limiter_stats": [l for l in text.splitlines() if any(k in l for k in LIMITER_LINES)][-24:]}
        if L.unit.mode == "hami":
            out["hami_pid_found"] = not any(s in text for s in HAMI_PID_FAILED)
        return out

    def compute_pids(self):
        """NVML's compute processes, or None (said the first time) when NVML cannot list them."""
        try:
            return self.nvml.compute_pids()
        except Exception as e:  # noqa: BLE001 - without the list, no NVML pids
            if not self.pid_list_failed:
                self.say(f"NVML process list unavailable ({type(e).__name__}: {e}): no per-process figures")
            self.pid_list_failed = True
            return None

    # Fractions of the window at which each vgpu tenant's usage file is read.
    STATUS_AT = (0.2, 0.4, 0.6, 0.8)

    def vgpu_status(self, L, start):
        """`vgpu status --json` of every tenant's usage file at STATUS_AT of the window: the
        first tenant's middle snapshot is kept whole (`out`), and each tenant's published
        utilization (what its limiter charged in its last 100 ms, summed over its processes)
        is kept per snapshot (`charged`), to set beside NVML's figure."""
        if not (self.args.vgpu and os.access(self.args.vgpu, os.X_OK)):
            return None
        env = dict(os.environ, VGPU_TURN_DIR=L.envs[0].get("VGPU_TURN_DIR", ""))
        caches = [e.get("CUDA_DEVICE_MEMORY_SHARED_CACHE", "") for e in L.envs]
        secs = self.args.seconds
        vgpu = self.args.vgpu

        class Snap(threading.Thread):
            out = None

            def run(snap):
                snap.charged = [[] for _ in caches]
                for k, at in enumerate(Bench.STATUS_AT):
                    time.sleep(max(0.0, start + secs * at - time.time()))
                    for i, cache in enumerate(caches):
                        try:
                            r = subprocess.run([vgpu, "status", "--json", "--cache", cache],
                                               capture_output=True, text=True, env=env, timeout=10)
                            text = r.stdout or r.stderr
                        except (OSError, subprocess.TimeoutExpired) as e:
                            text = f"failed: {e}"
                        if i == 0 and k == len(Bench.STATUS_AT) // 2:
                            snap.out = text[:20000]
                        util = charged_util(text)
                        if util is not None:
                            snap.charged[i].append(util)

        s = Snap(daemon=True)
        s.charged = [[] for _ in caches]
        s.start()
        return s

    # -- the whole bench --------------------------------------------------------------------

    def run(self, meta, write):
        self.hard_deadline = self.clock.t0 + self.args.budget + HARD_GRACE_S
        self.sampler.start()
        runs, est_done, took = self.runs, 0.0, 0.0
        units = self.units
        nxt = self.launch(units[0], 0) if units else None
        try:
            for k, unit in enumerate(units):
                cur = nxt
                nxt = None
                left = self.args.budget - self.clock.elapsed()
                need = time_needed(unit.est_s, est_done, took)
                if need > left:
                    cur.kill()
                    self.live.remove(cur)
                    rest = [u.name for u in units[k:]]
                    meta["skipped"].append(f"{len(rest)} run(s) from {unit.name} on: the next needs ~{need:.0f} s, "
                                           f"{left:.0f} s of the budget left ({', '.join(rest)})")
                    self.say(f"budget: skipping {len(rest)} run(s) from {unit.name} on "
                             f"(~{need:.0f} s needed, {left:.0f} s left)")
                    break
                self.say(f"run {k + 1}/{len(units)}: {unit.name} ({len(unit.tenants)} tenant(s), ~{need:.0f} s)")
                if k + 1 < len(units) and not self.args.no_overlap:
                    nxt = self.launch(units[k + 1], k + 1)
                rec = self.drive(cur)
                if nxt is not None:
                    rec["next_import_in_window_s"] = self.import_overlap(nxt, rec)
                elif k + 1 < len(units):
                    nxt = self.launch(units[k + 1], k + 1)
                runs.append(rec)
                est_done += unit.est_s
                # The first run's imports are planned apart (scenarios.first_import_s).
                took += rec["duration_s"] - (rec["park_wait_s"] if k == 0 else 0.0)
                self.say("  " + "; ".join(self.brief(t) for t in rec["tenants"]) +
                         f"; device {measure.fmt(rec['device_util'])}% ({rec['duration_s']:.1f} s)")
                for w in rec["warnings"]:
                    self.say(f"  warning: {w}")
                write(runs)
                if time.time() > self.hard_deadline:
                    meta["skipped"].append("the rest: past the budget's hard limit")
                    break
        finally:
            self.reap(wait_s=max(0.0, min(20.0, self.hard_deadline + 10.0 - time.time())))
            for L in list(self.live):
                L.kill()
            self.sampler.stop()
        meta["sampler_errors"] = self.sampler.errors
        return runs

    def import_overlap(self, L, rec):
        """Seconds of `rec`'s window during which `L` (the next run, started ahead) had tenants
        still importing (not yet parked at the gate): host load beside the measured run."""
        if "start" not in rec:
            return None
        ends = []
        for i in range(len(L.procs)):
            try:
                ends.append(os.path.getmtime(mark_path(L.dir, "parked", i)))
            except OSError:
                ends.append(time.time() if L.alive(i) else L.started)
        window_end = rec["start"] + self.args.seconds
        return round(max(0.0, min(max(ends), window_end) - rec["start"]), 3)

    @staticmethod
    def brief(t):
        r = t["result"]
        if not r.get("ok"):
            return f"{t['label']} FAILED ({r.get('phase', '?')}: {r.get('error', '')[:200]})"
        s = f"{t['label']} {r['rate']:.2f} {r.get('unit', '')}/s"
        if r.get("p50_ms") is not None:
            s += f" p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} ms"
        if t.get("nvml_util") is not None:
            s += f" nvml {t['nvml_util']:.0f}%"
        if t.get("charged_util") is not None:
            s += f" charged {t['charged_util']:.0f}%"
        if t.get("hami_pid_found") is False:
            s += " (HAMi found no host pid: not limited)"
        return s


def time_needed(est_s, est_done, took):
    """A run's estimate `est_s` scaled by how much longer the runs so far took than theirs
    (`took` s against `est_done` s estimated), never scaled down: the estimates' own margin
    stays."""
    return est_s * (max(1.0, took / est_done) if est_done > 0 else 1.0)


def parse(argv=None):
    p = argparse.ArgumentParser(description="Compute sharing on real workloads (see the module's docstring).")
    p.add_argument("--vgpu-lib", help="vgpu's libvgpu.so (vgpu-* modes)")
    p.add_argument("--hami-lib", help="HAMi-core's libvgpu.so (build_hami.sh; the hami mode)")
    p.add_argument("--vgpu", help="the vgpu CLI, for `vgpu status` snapshots (optional)")
    p.add_argument("--scenarios", default="core")
    p.add_argument("--modes", default=",".join(sc.MODES), help="comma-separated subset of the modes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-rounds", type=int, default=1)
    p.add_argument("--first-round", type=int, default=1,
                   help="the number of the first round (a later device call continues the alternation; "
                        "merge.py joins the calls' compute.json)")
    p.add_argument("--seconds", type=float, default=5.0, help="the timed window of every run")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole bench")
    p.add_argument("--out", default=os.environ.get("OUT", "out/compute"))
    p.add_argument("--work", help="where the runs' files go (default: a new temporary directory)")
    p.add_argument("--fake", action="store_true", help="sleeping tenants and a fake NVML (no GPU)")
    p.add_argument("--fake-fail", action="append", help=argparse.SUPPRESS)  # WORKLOAD=PHASE, tests
    p.add_argument("--plan-only", action="store_true", help="print the plan and exit")
    p.add_argument("--log-level", type=int, choices=(3, 4), default=3,
                   help="vgpu tenants' LIBCUDA_LOG_LEVEL: 4 keeps each limiter's heaviest identities "
                        "with their samples in the JSON")
    p.add_argument("--no-overlap", action="store_true",
                   help="start a run's tenants only after the previous run (no imports beside a "
                        "measured window; slower)")
    a = p.parse_args(argv)
    if a.rounds < 1 or not 1 <= a.min_rounds <= a.rounds or a.seconds <= 0 or a.budget <= 0:
        p.error("need rounds >= min-rounds >= 1 and positive --seconds and --budget")
    if a.fake:
        a.vgpu_lib = a.vgpu_lib or "/nonexistent/vgpu/libvgpu.so"
        a.hami_lib = a.hami_lib or "/nonexistent/hami/libvgpu.so"
    for name in ("vgpu_lib", "hami_lib", "vgpu"):
        v = getattr(a, name)
        if v and not a.fake:
            if not os.path.isfile(v):
                p.error(f"--{name.replace('_', '-')} {v}: no such file")
            setattr(a, name, os.path.abspath(v))
    return a


def modes_available(args, say):
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in wanted if m not in sc.MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; known: {', '.join(sc.MODES)}")
    out = []
    for m in wanted:
        lib = {"hami": args.hami_lib, "vgpu": args.vgpu_lib}.get(sc.HOOKED.get(m))
        if m in sc.HOOKED and not lib:
            say(f"mode {m}: left out (no --{sc.HOOKED[m]}-lib)")
            continue
        out.append(m)
    if sc.ALONE not in out:
        raise SystemExit("the alone mode is every percentage's reference: keep it in --modes")
    return tuple(out)


def main(argv=None, backend=None):
    args = parse(argv)
    clock = Clock()
    say = clock.say
    try:
        chosen = sc.select(args.scenarios)
    except ValueError as e:
        raise SystemExit(str(e))
    modes = modes_available(args, say)
    units, kept, rounds, skipped = sc.fit(chosen, args.rounds, args.min_rounds, args.seconds, args.budget, modes,
                                          args.first_round)
    say(f"plan: {len(kept)} scenario(s) x {rounds} round(s), {len(units)} runs, ~{sc.plan_cost(units):.0f} s "
        f"of the {args.budget:.0f} s budget; window {args.seconds:g} s; modes {', '.join(modes)}")
    for s in kept:
        cost = sum(u.est_s for u in units if u.scenario == s.name) / max(rounds, 1)
        say(f"  {s.name}: {', '.join(t.label for t in s.tenants)}; modes "
            f"{', '.join(m for m in s.modes if m in modes)}; ~{cost:.0f} s a round")
    alone_cost = sum(u.est_s for u in units if u.mode == sc.ALONE) / max(rounds, 1)
    say(f"  alone runs (shared by the scenarios of a round): ~{alone_cost:.0f} s a round")
    for u in units:
        say(f"    {u.name} ~{u.est_s:.0f} s")
    for x in skipped:
        say(f"  not run: {x}")
    if args.plan_only or not units:
        return 0
    os.makedirs(args.out, exist_ok=True)
    if backend is None:
        backend = (lambda b: measure.FakeNvml(b.live_ctx_pids)) if args.fake else open_nvml(say)
    bench = Bench(args, units, backend, clock)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:] if argv is None else list(argv),
            "seconds": args.seconds, "rounds": rounds, "budget_s": args.budget, "modes": list(modes),
            "scenarios": [s.name for s in kept], "skipped": list(skipped), "fake": args.fake,
            "libs": {"vgpu": args.vgpu_lib, "hami": args.hami_lib, "vgpu_cli": args.vgpu,
                     "vgpu_sha256": file_sha256(args.vgpu_lib)},
            "plan": [{"name": u.name, "est_s": round(u.est_s, 1)} for u in units],
            "device": bench.nvml.info(), "work": bench.work, "failures": []}
    say(f"device: {meta['device']}; files of the runs under {bench.work}")

    def write(runs):
        meta["failures"] = [f"{r['name']}: {t['label']}: {t['result'].get('phase', '?')}: "
                            f"{t['result'].get('error', '')[:300]}"
                            for r in runs for t in r["tenants"] if not t["result"].get("ok")]
        meta["warnings"] = [f"{r['name']}: {w}" for r in runs for w in r["warnings"]] + [
            f"{r['name']}: {t['label']}: HAMi-core found no host pid, so it did not limit this tenant"
            for r in runs for t in r["tenants"] if t.get("hami_pid_found") is False]
        summary = measure.summarize(runs, kept)
        with open(os.path.join(args.out, "compute.json.tmp"), "w") as f:
            json.dump({"meta": meta, "summary": summary_json(summary), "runs": runs}, f, indent=1)
        os.replace(os.path.join(args.out, "compute.json.tmp"), os.path.join(args.out, "compute.json"))
        with open(os.path.join(args.out, "compute.md"), "w") as f:
            f.write(measure.report(summary, kept, meta))
        return summary

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        bench.run(meta, write)
    except KeyboardInterrupt as e:
        say(f"interrupted ({e}); writing what was measured")
        meta["skipped"].append(f"interrupted: {e}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    runs = bench.runs
    summary = write(runs)
    print(measure.report(summary, kept, meta), flush=True)
    say(f"done: {len(runs)} run(s); {os.path.join(args.out, 'compute.md')} and compute.json")
    return 0 if runs and not meta["failures"] else 1


def file_sha256(path):
    """The file's SHA-256 (hex), or None without a readable file: what merge.py compares."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def open_nvml(say):
    try:
        return measure.NvmlBackend()
    except Exception as e:  # noqa: BLE001 - the bench runs on without NVML's figures
        say(f"NVML unavailable ({type(e).__name__}: {e}): no busy time, no per-process figures")
        return measure.NoNvml(str(e))


def summary_json(summary):
    """The summary with JSON keys (rounds as strings)."""
    return {s: {m: {**v, "per_round": {str(r): x for r, x in v["per_round"].items()}}
                for m, v in rows.items()} for s, rows in summary.items()}


if __name__ == "__main__":
    sys.exit(main())
