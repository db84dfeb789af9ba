"""The compute bench without a GPU: its arithmetic (schedules, windows, percentages, shares,
medians, tables), its plan (order, rotation, shared alone runs, what fits the budget), each
mode's environment, and the whole runner end to end on sleeping tenants (tenant.py's fake kind)
and a fake NVML, so that a device run does not fail on a name or a key.

    python3 -m unittest discover -s gpu-tests/compute -p 'test_*.py'   (cargo xtask test runs it)
"""
import contextlib
import glob
import io
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure  # noqa: E402
import run  # noqa: E402
import scenarios as sc  # noqa: E402
import tenant  # noqa: E402


class Files(unittest.TestCase):
    def test_every_file_compiles_and_the_scripts_parse(self):
        with tempfile.TemporaryDirectory() as d:
            for f in glob.glob(os.path.join(HERE, "*.py")):
                py_compile.compile(f, cfile=os.path.join(d, "x.pyc"), doraise=True)
        for f in glob.glob(os.path.join(HERE, "*.sh")):
            subprocess.run(["bash", "-n", f], check=True)

    def test_the_tenant_imports_no_framework_until_a_kind_needs_it(self):
        code = ("import sys; sys.path.insert(0, %r); import tenant, run; "
                "bad = [m for m in ('torch', 'timm', 'transformers', 'triton', 'cupy', 'pynvml') "
                "if m in sys.modules]; assert not bad, bad" % HERE)
        subprocess.run([sys.executable, "-c", code], check=True)


class Schedules(unittest.TestCase):
    def test_fixed_arrivals_every_interval_before_the_end(self):
        a = tenant.arrivals(0.01, 0.05)
        self.assertEqual(len(a), 5)
        for x, y in zip(a, [0, 0.01, 0.02, 0.03, 0.04]):
            self.assertAlmostEqual(x, y)

    def test_poisson_arrivals_repeat_with_their_seed_and_keep_the_mean_gap(self):
        a = tenant.arrivals(0.01, 100.0, poisson=True, seed=3)
        self.assertEqual(a, tenant.arrivals(0.01, 100.0, poisson=True, seed=3))
        self.assertNotEqual(a[:50], tenant.arrivals(0.01, 100.0, poisson=True, seed=4)[:50])
        gaps = [y - x for x, y in zip(a, a[1:])]
        self.assertAlmostEqual(sum(gaps) / len(gaps), 0.01, delta=0.0005)
        self.assertLess(max(a), 100.0)
        with self.assertRaises(ValueError):
            tenant.arrivals(0, 1)

    def test_quantiles_and_the_queue_depth(self):
        v = sorted(range(1, 101))
        self.assertEqual(tenant.quantile(v, 0.5), 51)
        self.assertEqual(tenant.quantile(v, 0.99), 100)
        self.assertIsNone(tenant.quantile([], 0.5))
        self.assertEqual(tenant.ring_depth(0.001), 20)  # 20 ms of 1 ms launches
        self.assertEqual(tenant.ring_depth(0.5), 2)
        self.assertEqual(tenant.ring_depth(1e-9), 512)


def run_tenant(*argv, timeout=30):
    p = subprocess.run([sys.executable, os.path.join(HERE, "tenant.py"), *argv],
                       capture_output=True, text=True, timeout=timeout)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    return p.returncode, json.loads(line[-1][7:]) if line else None


class FakeTenant(unittest.TestCase):
    def test_the_window_starts_at_the_given_time_and_counts_steps(self):
        start = time.time() + 2.0
        rc, r = run_tenant("fake", "--seconds", "0.5", "--start-at", repr(start),
                           "--fake-rate", "200", "--fake-share", "0.5")
        self.assertEqual(rc, 0, r)
        self.assertTrue(r["ok"])
        self.assertGreaterEqual(r["t0"], start)
        self.assertLess(r["t0"] - start, 0.05)
        self.assertAlmostEqual(r["t1"] - r["t0"], 0.5, delta=0.1)
        self.assertAlmostEqual(r["rate"], 100, delta=25)  # 200/s × 0.5, less the sleeps' overshoot
        self.assertEqual(r["unit"], "steps")

    def test_a_service_measures_latency_from_the_scheduled_arrival(self):
        # 8 ms requests every 5 ms: each waits behind the last, so latencies grow past 8 ms.
        rc, r = run_tenant("fake", "--seconds", "0.3", "--fake-latency-ms", "8", "--interval-ms", "5")
        self.assertEqual(rc, 0, r)
        # 60 arrivals; about 300 / 8 served in the window, the rest waiting at its end.
        self.assertEqual(len(r["lat_ms"]), 60)
        self.assertEqual(r["steps"] + r["unserved"], 60)
        self.assertAlmostEqual(r["steps"], 37, delta=8)
        self.assertLess(r["t1"] - r["t0"], 0.3 + 0.05)
        self.assertGreater(r["p99_ms"], 100)
        self.assertGreaterEqual(min(r["lat_ms"][:r["steps"]]), 8)  # the served ones come first
        self.assertGreater(r["late"], r["steps"] - 3)
        rc, r = run_tenant("fake", "--seconds", "0.3", "--fake-latency-ms", "2", "--interval-ms", "10")
        self.assertEqual((r["steps"], r["unserved"]), (30, 0))
        self.assertLess(r["p50_ms"], 6)
        self.assertLess(r["late"], r["steps"] // 3)  # only the host's own hiccups

    def test_a_failure_is_a_failed_result_and_a_fail_mark(self):
        with tempfile.TemporaryDirectory() as d:
            tenant.write_atomic(tenant.mark_path(d, "go", 0), "go")
            rc, r = run_tenant("fake", "--sync", d, "--index", "0", "--fake-fail", "build")
            self.assertEqual(rc, 1)
            self.assertFalse(r["ok"])
            self.assertEqual(r["phase"], "build")
            self.assertIn("fake failure in build", r["error"])
            for m in ("parked", "ctx", "fail"):
                self.assertTrue(os.path.exists(tenant.mark_path(d, m, 0)), m)
            self.assertFalse(os.path.exists(tenant.mark_path(d, "warm", 0)))

    def test_a_missing_framework_is_a_failed_result_not_a_crash(self):
        code = ("import sys; sys.modules['cupy'] = None; sys.path.insert(0, %r); import tenant; "
                "sys.exit(tenant.main(['spin', '--seconds', '0.1']))" % HERE)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 1)
        r = json.loads(p.stdout.split("RESULT ", 1)[1])
        self.assertEqual(r["phase"], "prepare")
        self.assertIn("cupy", r["error"])


class Environments(unittest.TestCase):
    LIBS = sc.Libraries(vgpu="/v/libvgpu.so", hami="/h/libvgpu.so")
    BASE = {"PATH": "/bin", "LD_PRELOAD": "/inherited.so", "CUDA_DEVICE_SM_LIMIT": "5", "VGPU_SM_MODE": "share"}

    def env(self, mode, t=sc.Tenant("matmul-4096", 30, 0), cache="/w/c0", turns="/w/turns"):
        return sc.tenant_env(self.BASE, mode, t, self.LIBS, cache, turns)

    def test_alone_and_plain_preload_nothing_and_inherit_no_setting(self):
        for mode in ("alone", "plain"):
            e = self.env(mode)
            self.assertEqual(e["PATH"], "/bin")
            for k in ("LD_PRELOAD", "CUDA_DEVICE_SM_LIMIT", "VGPU_SM_MODE", "CUDA_DEVICE_MEMORY_SHARED_CACHE"):
                self.assertNotIn(k, e)
            self.assertEqual(e["PYTORCH_NVML_BASED_CUDA_CHECK"], "1")

    def test_hami_limits_without_its_monitor(self):
        e = self.env("hami")
        self.assertEqual(e["LD_PRELOAD"], "/h/libvgpu.so")
        self.assertEqual(e["CUDA_REDIRECT"], "/h/libvgpu.so")
        self.assertEqual(e["GPU_CORE_UTILIZATION_POLICY"], "FORCE")
        self.assertEqual(e["CUDA_DEVICE_SM_LIMIT"], "30")
        self.assertEqual(e["CUDA_DEVICE_MEMORY_SHARED_CACHE"], "/w/c0")
        for k in ("VGPU_SM_MODE", "VGPU_TURN_DIR", "CUDA_TASK_PRIORITY"):
            self.assertNotIn(k, e)

    def test_vgpu_modes(self):
        cap, share, prio = self.env("vgpu-cap"), self.env("vgpu-share"), self.env("vgpu-prio")
        for e in (cap, share, prio):
            self.assertEqual(e["LD_PRELOAD"], "/v/libvgpu.so")
            self.assertEqual(e["VGPU_TURN_DIR"], "/w/turns")
            self.assertEqual(e["CUDA_DEVICE_SM_LIMIT"], "30")
            self.assertNotIn("GPU_CORE_UTILIZATION_POLICY", e)
        self.assertNotIn("VGPU_SM_MODE", cap)
        self.assertEqual(share["VGPU_SM_MODE"], "share")
        self.assertEqual(prio["VGPU_SM_MODE"], "share")
        self.assertNotIn("CUDA_TASK_PRIORITY", share)
        self.assertEqual(prio["CUDA_TASK_PRIORITY"], "0")
        best_effort = self.env("vgpu-share", sc.Tenant("matmul-4096"))
        self.assertNotIn("CUDA_DEVICE_SM_LIMIT", best_effort)

    def test_the_hook_without_a_limit_loads_vgpu_and_limits_nothing(self):
        e = self.env("vgpu-nolimit")
        self.assertEqual(e["LD_PRELOAD"], "/v/libvgpu.so")
        self.assertEqual(e["CUDA_DEVICE_MEMORY_SHARED_CACHE"], "/w/c0")
        for k in ("CUDA_DEVICE_SM_LIMIT", "VGPU_SM_MODE", "CUDA_TASK_PRIORITY"):
            self.assertNotIn(k, e)

    def test_a_hooked_mode_without_its_library_is_an_error(self):
        with self.assertRaises(ValueError):
            sc.tenant_env({}, "hami", sc.Tenant("spin", 30), sc.Libraries(vgpu="/v"), "c", "t")
        with self.assertRaises(ValueError):
            sc.tenant_env({}, "mps", sc.Tenant("spin", 30), self.LIBS, "c", "t")


class Plan(unittest.TestCase):
    def test_selection_by_name_and_set(self):
        self.assertEqual([s.name for s in sc.select("core")], list(sc.CORE))
        self.assertEqual(len(sc.select("all")), len(sc.SCENARIOS))
        self.assertEqual([s.name for s in sc.select("matmul-30-70,core")][0], "matmul-30-70")
        with self.assertRaises(ValueError):
            sc.select("core,nope")
        for s in sc.SCENARIOS.values():
            for t in s.tenants:
                self.assertIn(t.workload, sc.WORKLOADS)
                self.assertIn(t.kind, tenant.KINDS)

    def test_the_core_set_is_what_the_issue_asks(self):
        core = sc.select("core")
        pairs = [s for s in core if len(s.tenants) == 2 and not s.priority]
        self.assertTrue(any(all(t.kind.startswith("train-") for t in s.tenants) for s in pairs))
        self.assertEqual({tuple(t.sm for t in s.tenants) for s in pairs}, {(30, 70)})
        self.assertTrue(any(s.priority and any(t.service and t.priority == 0 for t in s.tenants) for s in core))
        self.assertTrue(any([t.sm for t in s.tenants] == [10, 20, 30, 40] for s in core))
        self.assertTrue(any(t.kind == "matmul" for s in pairs for t in s.tenants))

    def test_every_mode_once_per_round_rotated_and_alone_runs_shared(self):
        chosen = sc.select("core")
        units = sc.plan_units(chosen, 3, 5.0)
        for r in (1, 2, 3):
            ru = [u for u in units if u.round == r]
            alone = [u.tenants[0].workload for u in ru if u.mode == sc.ALONE]
            self.assertEqual(sorted(alone), sorted({t.workload for s in chosen for t in s.tenants}))
            for s in chosen:
                modes = [u.mode for u in ru if u.scenario == s.name]
                self.assertEqual(sorted(modes), sorted(m for m in s.modes if m != sc.ALONE))
                # An alone run of every tenant's workload comes before the scenario's
                # first mode or within its rotated order in this round.
                self.assertTrue(all(w in alone for w in (t.workload for t in s.tenants)))
        first = lambda r: [u.mode for u in units if u.round == r and u.scenario == "train-resnet18-vit"]
        self.assertNotEqual(first(1), first(2))
        self.assertNotEqual(first(2), first(3))
        # Alone runs carry no limit and no priority.
        self.assertTrue(all(t.sm is None and t.priority is None for u in units if u.mode == sc.ALONE
                            for t in u.tenants))

    def test_rotation(self):
        self.assertEqual(sc.rotated(("a", "b", "c"), 1), ("b", "c", "a"))
        self.assertEqual(sc.rotated(("a", "b", "c"), 4), ("b", "c", "a"))
        modes = ("alone", "plain", "hami", "vgpu-cap")
        orders = [sc.mode_order(modes, k) for k in range(4)]
        self.assertEqual(orders[0], modes)
        self.assertEqual(orders[1], ("hami", "alone", "vgpu-cap", "plain"))
        self.assertEqual(len(set(orders)), 4)
        self.assertTrue(all(sorted(o) == sorted(modes) for o in orders))
        self.assertEqual(sc.mode_order(("alone",), 3), ("alone",))

    def test_what_fits_the_budget(self):
        chosen = sc.select("core")
        full = sc.plan_cost(sc.plan_units(chosen, 2, 5.0))
        units, kept, rounds, skipped = sc.fit(chosen, 2, 1, 5.0, full + 1)
        self.assertEqual((len(kept), rounds, skipped), (5, 2, []))
        units, kept, rounds, skipped = sc.fit(chosen, 2, 1, 5.0, full - 1)
        self.assertEqual((len(kept), rounds), (5, 1))
        self.assertIn("round 2", skipped[0])
        one = sc.plan_cost(sc.plan_units(chosen, 1, 5.0))
        units, kept, rounds, skipped = sc.fit(chosen, 2, 1, 5.0, one - 1)
        self.assertEqual(rounds, 1)
        self.assertLess(len(kept), 5)
        self.assertEqual([s.name for s in kept], list(sc.CORE[:len(kept)]))
        self.assertTrue(sc.plan_cost(units) <= one - 1)
        self.assertTrue(any("train-quartet" in x for x in skipped))
        units, kept, rounds, skipped = sc.fit(chosen, 2, 1, 5.0, 1.0)
        self.assertEqual((units, kept), ([], []))

    def test_a_run_needs_its_estimate_scaled_by_the_overrun_so_far(self):
        self.assertEqual(run.time_needed(10.0, 0.0, 0.0), 10.0)
        self.assertEqual(run.time_needed(10.0, 100.0, 150.0), 15.0)
        self.assertEqual(run.time_needed(10.0, 100.0, 50.0), 10.0)


def tenant_rec(workload, rate, ok=True, nvml=None, p50=None, p99=None):
    r = {"ok": ok, "rate": rate, "t0": 0.0, "t1": 1.0}
    if p50 is not None:
        r.update(p50_ms=p50, p99_ms=p99)
    return {"workload": workload, "result": r, "nvml_util": nvml, "nvml_samples": 4 if nvml else 0}


def alone_run(rnd, workload, rate, busy, **kw):
    return {"round": rnd, "scenario": None, "mode": "alone", "device_util": busy,
            "tenants": [tenant_rec(workload, rate, **kw)]}


def scen_run(rnd, scenario, mode, recs, util=99.0):
    return {"round": rnd, "scenario": scenario, "mode": mode, "device_util": util, "tenants": recs}


class Figures(unittest.TestCase):
    def test_window_means(self):
        dev = [(0.9, 10.0), (1.0, 50.0), (1.5, 70.0), (2.0, 90.0), (2.1, 0.0)]
        self.assertAlmostEqual(measure.device_mean(dev, 1.0, 2.0), 70.0)
        self.assertIsNone(measure.device_mean(dev, 5, 6))
        proc = {(7, 1_100_000): 30.0, (7, 1_900_000): 50.0, (7, 3_000_000): 99.0, (8, 1_500_000): 60.0}
        self.assertEqual(measure.process_mean(proc, 7, 1.0, 2.0), (40.0, 2))
        self.assertEqual(measure.process_mean(proc, 9, 1.0, 2.0), (None, 0))

    def test_throughput_and_the_two_shares(self):
        alone = dict(tenant_rec("a", 40.0), device_util=80.0)
        f = measure.tenant_figures(tenant_rec("a", 12.0, nvml=27.0), alone)
        self.assertAlmostEqual(f["thr_pct"], 30.0)
        self.assertAlmostEqual(f["share_a"], 24.0)  # 30% of an 80%-busy alone run
        self.assertEqual(f["share_b"], 27.0)
        failed = measure.tenant_figures(tenant_rec("a", 12.0, ok=False), alone)
        self.assertIsNone(failed["thr_pct"])
        self.assertIsNone(measure.tenant_figures(tenant_rec("a", 12.0), None)["thr_pct"])

    def test_a_services_latency_against_alone_and_plain(self):
        alone = dict(tenant_rec("s", 100.0, p50=4.0, p99=8.0), device_util=30.0)
        plain = tenant_rec("s", 100.0, p50=5.0, p99=16.0)
        f = measure.tenant_figures(tenant_rec("s", 100.0, p50=4.4, p99=12.0), alone, plain)
        self.assertAlmostEqual(f["p50_vs_alone"], 1.1)
        self.assertAlmostEqual(f["p99_vs_alone"], 1.5)
        self.assertAlmostEqual(f["p50_vs_plain"], 0.88)
        self.assertAlmostEqual(f["p99_vs_plain"], 0.75)
        self.assertTrue(f["service"])

    def runs(self):
        """Three rounds of a 30/70 pair; round 2's 30% tenant failed in share mode."""
        out = []
        for rnd, (a, b) in enumerate([(40.0, 20.0), (44.0, 22.0), (36.0, 18.0)], start=1):
            out += [alone_run(rnd, "x", a, 90.0), alone_run(rnd, "y", b, 50.0)]
            out.append(scen_run(rnd, "pair", "plain", [tenant_rec("x", a * 0.6), tenant_rec("y", b * 0.5)]))
            out.append(scen_run(rnd, "pair", "vgpu-share", [
                tenant_rec("x", a * (0.3 + 0.01 * rnd), ok=rnd != 2), tenant_rec("y", b * 0.7)]))
        return out

    def test_medians_of_per_round_percentages(self):
        s = sc.Scenario("pair", (sc.Tenant("matmul-4096", 30), sc.Tenant("matmul-4096", 70)),
                        (sc.ALONE, "plain", "vgpu-share"))
        summary = measure.summarize(self.runs(), [s])["pair"]
        self.assertEqual(list(summary), [sc.ALONE, "plain", "vgpu-share"])
        share = summary["vgpu-share"]
        self.assertEqual(share["rounds"], [1, 2, 3])
        x, y = share["tenants"]
        self.assertAlmostEqual(x["thr_pct"], 32.0)  # the median of rounds 1 and 3: 31, 33
        self.assertEqual(x["ok_rounds"], 2)
        self.assertAlmostEqual(y["thr_pct"], 70.0)
        self.assertAlmostEqual(x["share_a"], 32.0 * 0.9)
        self.assertAlmostEqual(summary["plain"]["sum_thr"], 110.0)
        self.assertAlmostEqual(share["sum_thr"], 102.0)  # rounds 1 and 3: 31 + 70, 33 + 70
        alone = summary[sc.ALONE]["tenants"]
        self.assertAlmostEqual(alone[0]["thr_pct"], 100.0)
        self.assertAlmostEqual(alone[1]["rate"], 20.0)
        lines = measure.table(s, summary)
        self.assertEqual(len(lines), 2 + 3)
        self.assertIn("| vgpu-share | 32.0 | 28.8 |", lines[-1])
        # x keeps the GPU 90% busy alone, y 50%: at caps of 30 and 70, 33.3% and all of y's.
        self.assertAlmostEqual(measure.cap_ideal(s, summary), 100 * 30 / 90 + 100)
        svc = sc.Scenario("p", (sc.Tenant("svc-gpt-b1", 50, 0), sc.Tenant("matmul-4096", 50, 1)))
        self.assertIsNone(measure.cap_ideal(svc, summary))

    def test_a_service_row_marks_a_lower_bound_when_requests_were_left_waiting(self):
        s = sc.Scenario("p", (sc.Tenant("svc-gpt-b1", 50, 0), sc.Tenant("matmul-4096", 50, 1)),
                        (sc.ALONE, "plain", "vgpu-prio"))
        svc = lambda p50, p99: dict(tenant_rec("svc-gpt-b1", 100.0, p50=p50, p99=p99),
                                    nvml_util=20.0, nvml_samples=5)
        runs = [alone_run(1, "svc-gpt-b1", 100.0, 25.0, p50=4.0, p99=8.0),
                alone_run(1, "matmul-4096", 50.0, 99.0),
                scen_run(1, "p", "plain", [svc(6.0, 40.0), tenant_rec("matmul-4096", 25.0)]),
                scen_run(1, "p", "vgpu-prio", [svc(4.4, 12.0), tenant_rec("matmul-4096", 20.0)])]
        runs[2]["tenants"][0]["result"]["unserved"] = 3  # plain left three waiting
        lines = measure.table(s, measure.summarize(runs, [s])["p"])
        self.assertIn("| plain | 6.00 / ≥40.00 | 1.50 / 5.00 |  | 20.0 (5) | 50.0 |", lines[3])
        self.assertIn("| vgpu-prio | 4.40 / 12.00 | 1.10 / 1.50 | 0.73 / 0.30 | 20.0 (5) | 40.0 |", lines[4])
        self.assertIn("best-effort thr %", lines[0])

    def test_a_tenant_failed_in_every_round_reads_failed(self):
        s = sc.Scenario("pair", (sc.Tenant("matmul-4096", 30), sc.Tenant("matmul-4096", 70)),
                        (sc.ALONE, "plain"))
        runs = [alone_run(1, "x", 40.0, 90.0), alone_run(1, "y", 20.0, 50.0),
                scen_run(1, "pair", "plain", [tenant_rec("x", 1.0, ok=False), tenant_rec("y", 10.0)])]
        lines = measure.table(s, measure.summarize(runs, [s])["pair"])
        self.assertIn("| plain | failed |", lines[-1])


class Sampling(unittest.TestCase):
    def test_samples_are_kept_once_and_the_cursor_moves_on(self):
        class Backend:
            calls = []

            def device_util(self):
                return 55.0

            def process_samples(self, since_us):
                self.calls.append(since_us)
                return [(7, 1_000_000, 20.0), (7, 2_000_000, 40.0)]

        s = measure.Sampler(Backend())
        s.sample_once()
        s.sample_once()
        self.assertEqual(Backend.calls, [0, 2_000_000])
        self.assertEqual(len(s.proc), 2)
        self.assertEqual(s.process_mean(7, 0.5, 2.5), (30.0, 2))
        self.assertEqual(len(s.dev), 2)

    def test_a_failing_nvml_is_noted_not_raised(self):
        s = measure.Sampler(measure.NoNvml("no driver"))
        for _ in range(30):
            s.sample_once()
        self.assertEqual(len(s.errors), 20)
        self.assertIn("no driver", s.errors[0])
        self.assertIsNone(s.device_mean(0, time.time()))


class ChargedUtil(unittest.TestCase):
    def test_a_containers_charged_share_is_its_processes_published_utilization(self):
        status = {"processes": [{"pid": 1, "devices": [{"index": 0, "sm_utilization_percent": 43}]},
                                {"pid": 2, "devices": [{"index": 0, "sm_utilization_percent": 7}]}]}
        self.assertEqual(run.charged_util(json.dumps(status)), 50.0)
        self.assertEqual(run.charged_util(json.dumps({"processes": []})), 0.0)
        # A failed call or another document is no figure, not a crash.
        for text in ("failed: timed out", "{}", "[1, 2]", '{"processes": 3}'):
            self.assertIsNone(run.charged_util(text), text)


class HamiHostPid(unittest.TestCase):
    def test_a_tenant_whose_hami_found_no_host_pid_is_marked(self):
        class Done:
            pid = 1

            def poll(self):
                return 0

        with tempfile.TemporaryDirectory() as d:
            err = os.path.join(d, "t0.err")
            with open(err, "w") as f:
                f.write("[HAMI-core Warn(1:2:libvgpu.c:912)]: SET_TASK_PID FAILED - using container PID\n"
                        + "x" * 10000 + "\nlimiter stats: none\n")
            for mode, found in (("hami", False), ("vgpu-cap", None)):
                L = run.Launched(sc.Unit(1, mode, (sc.Tenant("spin", 30),), "s"), d, [Done()], [{}],
                                 [(os.path.join(d, "t0.out"), err, [])])
                f = run.Bench.exit_fields(L, 0)
                self.assertEqual(f.get("hami_pid_found"), found)
                self.assertEqual(f["limiter_stats"], ["limiter stats: none"])
                self.assertEqual(len(f["stderr_tail"]), run.STDERR_TAIL)
            with open(err, "w") as f:
                f.write("[HAMI-core Msg(1:2:libvgpu.c:905)]: Initialized\n")
            L = run.Launched(sc.Unit(1, "hami", (sc.Tenant("spin", 30),), "s"), d, [Done()], [{}],
                             [(os.path.join(d, "t0.out"), err, [])])
            self.assertTrue(run.Bench.exit_fields(L, 0)["hami_pid_found"])


class EndToEnd(unittest.TestCase):
    """run.py on sleeping tenants: processes, handshake, rotation, medians, tables, JSON."""

    def tmp(self, prefix):
        d = tempfile.mkdtemp(prefix=prefix)
        self.addCleanup(shutil.rmtree, d, True)
        return d

    def bench(self, *argv):
        out = self.tmp("cb-out-")
        work = self.tmp("cb-work-")
        p = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--fake", "--out", out,
                            "--work", os.path.join(work, "w"), *argv],
                           capture_output=True, text=True, timeout=240)
        with open(os.path.join(out, "compute.json")) as f:
            data = json.load(f)
        with open(os.path.join(out, "compute.md")) as f:
            md = f.read()
        return p, data, md

    def test_two_rounds_of_a_pair_and_a_priority_scenario(self):
        p, data, md = self.bench("--scenarios", "train-resnet18-vit,prio-gpt-svc-vit", "--rounds", "2",
                                 "--seconds", "0.4", "--budget", "300")
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        runs = data["runs"]
        self.assertEqual([r["name"] for r in runs], [u["name"] for u in data["meta"]["plan"]])
        self.assertEqual(len(runs), 2 * (3 + 4 + 4))  # alone runs (3 workloads) + each scenario's modes
        for r in runs:
            self.assertTrue(all(t["result"]["ok"] for t in r["tenants"]), r["name"])
            # One window for the run: every tenant's starts at the run's start.
            for t in r["tenants"]:
                self.assertGreaterEqual(t["result"]["t0"], r["start"])
                self.assertLess(t["result"]["t0"] - r["start"], 0.5)  # a loaded host's hiccups
                self.assertEqual(t["nvml_pid"], t["pid"])
                self.assertEqual(t["returncode"], 0)  # completed once the tenant exited
                if os.geteuid() == 0:  # imported at niceness 10, measured at 0
                    self.assertEqual(t["result"]["nice"], 0)
                self.assertEqual(t["limiter_stats"], [])
        hooked = [t for r in runs if r["mode"] == "vgpu-share" for t in r["tenants"]]
        self.assertTrue(all(t["env"]["FAKE_LD_PRELOAD"] == "/nonexistent/vgpu/libvgpu.so" for t in hooked))
        self.assertEqual(len({t["env"]["CUDA_DEVICE_MEMORY_SHARED_CACHE"] for t in hooked}), len(hooked))
        turn_dirs = {r["name"]: {t["env"]["VGPU_TURN_DIR"] for t in r["tenants"]}
                     for r in runs if r["mode"] == "vgpu-share"}
        self.assertTrue(all(len(d) == 1 for d in turn_dirs.values()))
        self.assertEqual(len(set.union(*turn_dirs.values())), len(turn_dirs))
        # The fake runs a limited tenant at its limit, plain at half: the medians say so.
        pair = data["summary"]["train-resnet18-vit"]
        self.assertEqual(list(pair), ["alone", "plain", "hami", "vgpu-cap", "vgpu-share"])
        for mode in ("hami", "vgpu-cap", "vgpu-share"):
            x, y = pair[mode]["tenants"]
            self.assertEqual(pair[mode]["rounds"], [1, 2])
            self.assertAlmostEqual(x["thr_pct"], 30, delta=6)
            self.assertAlmostEqual(y["thr_pct"], 70, delta=10)
            self.assertAlmostEqual(x["share_a"], 0.9 * x["thr_pct"], delta=0.01)  # alone busy 90
        self.assertAlmostEqual(pair["plain"]["tenants"][0]["thr_pct"], 50, delta=8)
        self.assertEqual(len(pair["vgpu-share"]["per_round"]), 2)
        prio = data["summary"]["prio-gpt-svc-vit"]
        svc = prio["vgpu-prio"]["tenants"][0]
        # Its ratios are the medians of each round's against the same round's plain run.
        raw = lambda rnd, mode: next(r for r in runs if r["round"] == rnd and r["mode"] == mode
                                     and r["scenario"] == "prio-gpt-svc-vit")["tenants"][0]["result"]
        per_round = [raw(rnd, "vgpu-prio")["p99_ms"] / raw(rnd, "plain")["p99_ms"] for rnd in (1, 2)]
        self.assertAlmostEqual(svc["p99_vs_plain"], sum(per_round) / 2)
        self.assertIsNotNone(prio["vgpu-prio"]["tenants"][1]["thr_pct"])
        # Rotation: the pair's modes ran in another order in round 2.
        order = lambda rnd: [r["mode"] for r in runs if r["round"] == rnd and r["scenario"] == "train-resnet18-vit"]
        self.assertNotEqual(order(1), order(2))
        self.assertIn("## train-resnet18-vit", md)
        self.assertIn("| vgpu-prio |", md)
        self.assertNotIn("failed", md)
        self.assertRegex(p.stdout, r"\[\d\d:\d\d:\d\d \+ *\d+\.\ds\] run 1/22")
        overlap = [r["next_import_in_window_s"] for r in runs[:-1]]
        self.assertTrue(all(0 <= x <= 0.4 for x in overlap), overlap)
        self.assertNotIn("next_import_in_window_s", runs[-1])

    def test_a_failing_tenant_is_reported_and_the_bench_goes_on(self):
        p, data, md = self.bench("--scenarios", "matmul-30-70,train-resnet18-vit", "--rounds", "1",
                                 "--modes", "alone,plain,vgpu-cap", "--seconds", "0.3",
                                 "--fake-fail", "vit-s-b256=build")
        self.assertEqual(p.returncode, 1)
        names = [r["name"] for r in data["runs"]]
        self.assertEqual(len(names), len(data["meta"]["plan"]))
        vit = [t for r in data["runs"] for t in r["tenants"] if t["workload"] == "vit-s-b256"]
        self.assertTrue(vit and all(not t["result"]["ok"] and t["result"]["phase"] == "build" for t in vit))
        others = [t for r in data["runs"] for t in r["tenants"] if t["workload"] != "vit-s-b256"]
        self.assertTrue(all(t["result"]["ok"] for t in others))
        matmul = data["summary"]["matmul-30-70"]["vgpu-cap"]["tenants"]
        self.assertAlmostEqual(matmul[0]["thr_pct"], 30, delta=6)
        self.assertRegex(md.split("## train-resnet18-vit")[1],
                         r"\| plain \| \d+\.\d \| [-\d.]+ \| [-\d.]+ \(\d+\) \| failed \|")
        self.assertIn("failed", md)
        self.assertIn("## Failures", md)
        self.assertIn("fake failure in build", md)

    def test_without_nvml_and_without_overlap_the_bench_still_measures_throughput(self):
        out = self.tmp("cb-out-")
        argv = ["--fake", "--out", out, "--work", os.path.join(self.tmp("cb-work-"), "w"),
                "--scenarios", "matmul-30-70", "--rounds", "1", "--seconds", "0.3",
                "--modes", "alone,plain,vgpu-cap", "--no-overlap"]
        with contextlib.redirect_stdout(io.StringIO()) as said:
            rc = run.main(argv, backend=measure.NoNvml("no driver"))
        self.assertIn("| vgpu-cap |", said.getvalue())
        self.assertEqual(rc, 0)
        with open(os.path.join(out, "compute.json")) as f:
            data = json.load(f)
        self.assertTrue(data["meta"]["sampler_errors"])
        for r in data["runs"]:
            self.assertIsNone(r["device_util"])
            self.assertNotIn("next_import_in_window_s", r)
            for t in r["tenants"]:
                self.assertIsNone(t["nvml_pid"])
                self.assertTrue(t["result"]["ok"])
        cap = data["summary"]["matmul-30-70"]["vgpu-cap"]["tenants"]
        self.assertAlmostEqual(cap[1]["thr_pct"], 70, delta=10)
        self.assertIsNone(cap[1]["share_a"])

    def test_the_plan_leaves_out_what_the_budget_cannot_hold_and_says_so(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--fake", "--plan-only",
                            "--scenarios", "core", "--seconds", "5", "--budget", "200"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("not run: round 2", p.stdout)
        self.assertIn("not run: scenario train-quartet", p.stdout)
        p = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--scenarios", "nope"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("unknown scenario", p.stderr)

    def test_modes_without_their_library_are_left_out(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), "--plan-only", "--scenarios", "spin-30-70"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("mode hami: left out (no --hami-lib)", p.stdout)
        self.assertIn("modes alone, plain\n", p.stdout)



class Merge(unittest.TestCase):
    """Rounds spread over device calls: --first-round continues the alternation, merge.py joins."""

    def doc(self, rounds, sha="a" * 64):
        runs = []
        for r in rounds:
            runs += [alone_run(r, "matmul-4096", 100.0, 100.0),
                     scen_run(r, "matmul-30-70", "plain", [tenant_rec("matmul-4096", 40.0 + r),
                                                           tenant_rec("matmul-4096", 45.0)])]
        return {"meta": {"libs": {"vgpu": "/x/libvgpu.so", "vgpu_sha256": sha}, "scenarios": ["matmul-30-70"],
                         "date": "d", "failures": [], "warnings": [], "skipped": []}, "runs": runs}

    def write(self, d, name, doc):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def test_a_later_call_continues_the_alternation(self):
        both = sc.plan_units([sc.SCENARIOS["matmul-30-70"]], 3, 5.0)
        later = sc.plan_units([sc.SCENARIOS["matmul-30-70"]], 1, 5.0, first_round=3)
        self.assertEqual([u.name for u in later], [u.name for u in both if u.round == 3])

    def test_rounds_of_two_calls_give_one_median_and_overlaps_or_other_builds_are_refused(self):
        import merge
        with tempfile.TemporaryDirectory() as d:
            a = self.write(d, "a.json", self.doc([1, 2]))
            b = self.write(d, "b.json", self.doc([3]))
            meta, runs, kept = merge.merge([a, b])
            self.assertEqual(meta["rounds"], 3)
            rows = measure.summarize(runs, kept)["matmul-30-70"]["plain"]
            self.assertEqual(sorted(rows["per_round"]), [1, 2, 3])
            with self.assertRaisesRegex(ValueError, "round 1 is in both"):
                merge.merge([a, a])
            other = self.write(d, "c.json", self.doc([4], sha="b" * 64))
            with self.assertRaisesRegex(ValueError, "different vgpu libraries"):
                merge.merge([a, other])
            self.assertEqual(merge.main([os.path.join(d, "out"), a, b]), 0)
            with open(os.path.join(d, "out", "compute.md")) as f:
                self.assertIn("matmul-30-70", f.read())


class AB(unittest.TestCase):
    def test_two_builds_alternate_and_each_round_is_against_its_own_alone(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "ab")
            env = dict(os.environ, RUN_OPTS="--fake --seconds 0.2")
            p = subprocess.run(
                ["bash", os.path.join(HERE, "ab.sh"), out, "2", "solo-resnet18-95",
                 "alone,vgpu-cap", "a=/x/libvgpu.so", "b=/y/libvgpu.so@VGPU_DIAG_NO_EVENTS=1"],
                env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
            for build in ("a", "b"):
                for r in (1, 2):
                    self.assertTrue(os.path.exists(os.path.join(out, build, f"r{r}", "compute.json")))
            with open(os.path.join(out, "ab.md")) as f:
                table = f.read()
            self.assertIn("| solo-resnet18-95 | vgpu-cap | 0 | a | 2 |", table)
            self.assertIn("| solo-resnet18-95 | alone | 0 | b | 2 | 100.0 |", table)

    def test_modes_without_alone_are_refused(self):
        p = subprocess.run(["bash", os.path.join(HERE, "ab.sh"), "/tmp/x", "1", "spin-30-70",
                            "vgpu-cap", "a=/x.so"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("need alone", p.stderr)


if __name__ == "__main__":
    unittest.main()
