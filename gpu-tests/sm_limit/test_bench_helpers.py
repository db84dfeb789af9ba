"""The share-mode bench's own arithmetic, without a GPU: the timelines it runs, the figures
and verdicts it prints from the tenants' stamps, and the tenants' environments. A wrong
verdict here is a wrong claim in docs/benchmarks.md (a pair given each other's priorities, a
live change judged over too short a window to hold its new split).

    python3 -m unittest discover -s gpu-tests/sm_limit -p 'test_*.py'   (cargo xtask test runs it)
"""
import json
import os
import random
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import elastic  # noqa: E402
import priority  # noqa: E402


def idle_of(argv):
    """The --idle ranges of a tenant's command line, [(from, to)] seconds."""
    return [tuple(map(float, argv[i + 1].split(":"))) for i, x in enumerate(argv) if x == "--idle"]


def stamps_every(period, seconds, idle=()):
    """Request start times every `period` s over `seconds`, none inside an `idle` range."""
    t, out = 0.0, []
    while t < seconds:
        if not any(a <= t < b for a, b in idle):
            out.append(round(t, 4))
        t += period
    return out


class PrioritySchedule(unittest.TestCase):
    def test_slots_alternate_and_each_slots_start_is_not_counted(self):
        seconds, counted, service_idle, other_idle = priority.priority_schedule()
        self.assertEqual(seconds, 24.0)
        self.assertEqual(len(counted["A"]), 4)
        self.assertEqual(len(counted["B"]), 8)
        self.assertEqual(len(counted["C"]), 4)
        for c, phases in counted.items():
            for a, b in phases:
                self.assertAlmostEqual(b - a, priority.PRIORITY_SLOT_S - priority.PRIORITY_SETTLE_S)
        # The service idles in the best-effort tenant's alone slots and vice versa; both run
        # in the "both" slots.
        self.assertEqual(service_idle, [(a - 0.5, b) for a, b in counted["C"]])
        self.assertEqual(other_idle, [(a - 0.5, b) for a, b in counted["A"]])
        for a, b in counted["B"]:
            self.assertFalse(any(x < b and a < y for x, y in service_idle + other_idle))

    def test_idle_args_name_every_range(self):
        self.assertEqual(bench_common.idle_args([(0, 1.5), (6, 7.5)]),
                         ["--idle", "0:1.5", "--idle", "6:7.5"])


class PriorityFigures(unittest.TestCase):
    def timeline(self, alone_ms, both_ms, trainer_alone, trainer_both):
        """A service with `alone_ms` latencies alone and `both_ms` beside the best-effort
        tenant, which runs `trainer_alone` steps/s alone and `trainer_both` beside it."""
        seconds, counted, service_idle, other_idle = priority.priority_schedule()
        st = stamps_every(0.014, seconds, service_idle)
        in_b = lambda t: any(a - 0.5 <= t < b for a, b in counted["B"])
        ri = {"stamps": st, "lat": [both_ms if in_b(t) else alone_ms for t in st],
              "host_ms": [alone_ms - 0.1 for _ in st]}
        bin_s = 0.05
        bins = []
        for i in range(int(seconds / bin_s)):
            t = i * bin_s
            if any(a <= t < b for a, b in other_idle):
                bins.append(0.0)
            else:
                bins.append(trainer_both if in_b(t) else trainer_alone)
        rt = {"bins": bins, "bin_s": bin_s}
        return ri, rt, counted

    def test_ratios_against_the_same_process_alone_and_the_best_effort_rate(self):
        ri, rt, counted = self.timeline(4.0, 4.8, 40.0, 24.0)
        f = priority.priority_figures(ri, rt, counted)
        self.assertEqual(set(f["alone"]), {4.0})
        self.assertEqual(set(f["both"]), {4.8})
        self.assertAlmostEqual(f["best_effort"], 0.6)
        line = priority.priority_line("share", ri, rt, {"p50_ms": 4.0}, None, counted)
        cells = [c.strip() for c in line.split("|")[1:-1]]
        self.assertEqual(cells[3], "1.20")  # p50 both / alone
        self.assertEqual(cells[7], "60.0")  # best-effort both, % of alone
        self.assertEqual(cells[8], "PASS")

    def test_the_verdict_fails_past_a_quarter_or_under_half_the_best_effort_rate(self):
        ri, rt, counted = self.timeline(4.0, 5.2, 40.0, 30.0)
        self.assertTrue(priority.priority_line("x", ri, rt, None, None, counted).endswith("| FAIL |"))
        ri, rt, counted = self.timeline(4.0, 4.4, 40.0, 19.0)
        self.assertTrue(priority.priority_line("x", ri, rt, None, None, counted).endswith("| FAIL |"))

    def test_against_plain_in_the_same_run(self):
        ri, rt, counted = self.timeline(4.0, 4.4, 40.0, 30.0)
        plain = {"both": [5.5] * 100}
        cells = priority.priority_line("share", ri, rt, None, plain, counted).split("|")
        self.assertEqual(cells[6].strip(), "0.80, 0.80")

    def test_the_gpu_wait_is_latency_less_host_launch_time(self):
        ri, rt, counted = self.timeline(4.0, 4.8, 40.0, 24.0)
        self.assertIn("GPU wait p50 0.10 / 0.90 ms", priority.gpu_wait(ri, counted))
        medians = priority.slot_medians(ri, counted).split()
        self.assertEqual(medians[:3], ["A4.0/3.9", "B4.8/3.9", "B4.8/3.9"])
        self.assertEqual(priority.gpu_wait({"stamps": [], "lat": []}, counted), "")


class SettleTime(unittest.TestCase):
    def test_a_change_is_settled_once_the_window_holds_the_new_split(self):
        bin_s, at = 0.05, 3.0
        n = int(8 / bin_s)
        # 30/70 before, 70/30 from 3.2 s.
        a = [30 if i * bin_s < 3.2 else 70 for i in range(n)]
        b = [70 if i * bin_s < 3.2 else 30 for i in range(n)]
        t = elastic.settle_time(a, b, bin_s, at, 0.70)
        # The 400 ms window first holds only the new split at 3.2 + 0.4 s.
        self.assertAlmostEqual(t, 0.6, places=6)

    def test_one_bins_swing_does_not_unsettle_a_400_ms_window(self):
        # Run 17: a 10% tenant's 50 ms bins gain or lose one 4 ms turn's launches at their
        # edges. Over 200 ms one such bin moves its part past 3 points; over 400 ms it does not.
        bin_s, at = 0.05, 3.0
        n = int(8 / bin_s)
        a = [10] * n
        b = [90] * n
        a[100], b[100] = 24, 76  # at 5.0 s, 2 s after the change
        self.assertGreater(elastic.settle_time(a, b, bin_s, at, 0.10, window=0.2), 2.0)
        self.assertAlmostEqual(elastic.settle_time(a, b, bin_s, at, 0.10), 0.05)

    def test_never_settled_is_none(self):
        a, b = [50] * 160, [50] * 160
        self.assertIsNone(elastic.settle_time(a, b, 0.05, 3.0, 0.10))


class FourPhases(unittest.TestCase):
    SHARES = (10, 20, 30, 40)

    def test_all_busy_needs_each_share_within_half_a_point_and_a_busy_device(self):
        busy = [0, 1, 2, 3]
        self.assertTrue(elastic.four_phase_ok([10.2, 20.3, 29.9, 39.6], 99.5, busy, self.SHARES))
        # A 40% tenant with 39.3 of 99.7 (39.45% of what the four got) is 0.55 under.
        self.assertFalse(elastic.four_phase_ok([10.3, 20.3, 29.8, 39.3], 99.7, busy, self.SHARES))
        self.assertFalse(elastic.four_phase_ok([10, 20, 30, 40], 94.9, busy, self.SHARES))
        self.assertFalse(elastic.four_phase_ok([10, 20, 30, 40], None, busy, self.SHARES))

    def test_an_idle_tenants_share_is_lent_in_proportion(self):
        # 30% idle: the others are due 10/70, 20/70, 40/70 of the busy time.
        busy = [0, 1, 3]
        self.assertTrue(elastic.four_phase_ok([14.3, 28.6, 0, 57.1], 99, busy, self.SHARES))
        # The 40% tenant 56.0 of its 57.1: short.
        self.assertFalse(elastic.four_phase_ok([14.7, 29.1, 0, 56.0], 99.8, busy, self.SHARES))

    def test_a_guarantee_is_of_the_devices_time_and_an_idle_ones_share_is_on_top(self):
        every = [0, 1, 2, 3]
        # All busy: the 40% tenant 39.4 of the device's 99.9%, 0.6 under its guarantee.
        self.assertFalse(elastic.guarantees_held([10.0, 20.1, 30.4, 39.4], 99.9, every, self.SHARES))
        self.assertTrue(elastic.guarantees_held([10.0, 20.1, 30.3, 39.5], 99.9, every, self.SHARES))
        # 20% idle: out of proportion (the 40% one 48.5 of its 50), each far above its
        # guarantee.
        self.assertTrue(elastic.guarantees_held([12.5, 0, 38.1, 48.5], 99.0, [0, 2, 3], self.SHARES))
        self.assertFalse(elastic.guarantees_held([12.5, 0, 38.1, 48.5], 94.0, [0, 2, 3], self.SHARES))
        self.assertFalse(elastic.guarantees_held([12.5, 0, 38.1, 48.5], None, [0, 2, 3], self.SHARES))


class SparseService(unittest.TestCase):
    def test_the_row_compares_with_the_service_alone_after_two_warm_up_requests(self):
        alone = {"lat": [50.0, 9.0] + [4.0] * 15}
        beside = {"lat": [60.0, 12.0] + [4.5] * 14 + [6.0]}
        cells = [c.strip() for c in priority.sparse_line("share", beside, alone).split("|")[1:-1]]
        self.assertEqual(cells, ["share", "15", "4.50 / 6.00", "1.12, 1.50", "+0.50"])
        self.assertIn("failed", priority.sparse_line("share", None, alone))


class HookCost(unittest.TestCase):
    def test_every_hook_mode_starts_and_takes_its_own_slots(self):
        with tempfile.TemporaryDirectory() as work:
            b = FakeTenants("/nonexistent/libvgpu.so", work, slow=(4,))
            said = []
            bare = priority.hook_cost(b, said.append, priority.HOOK_COST_VARIANTS)
        self.assertAlmostEqual(bare["p50_ms"], 4.0)
        k = len(priority.HOOK_COST_VARIANTS) + 1
        self.assertEqual(len(b.started), k)
        # The slots of the processes never overlap and leave none empty.
        active = []
        for _env, argv in b.started:
            idle = idle_of(argv)
            seconds = float(argv[3])
            active.append([t / 10 for t in range(int(seconds * 10))
                           if not any(a <= t / 10 < z for a, z in idle)])
        every = sorted(t for a in active for t in a)
        self.assertEqual(every, sorted(set(every)))
        self.assertEqual(len(every), int(float(b.started[0][1][3]) * 10))
        # Hooked ones preload the library; the share-mode ones have a board each.
        self.assertNotIn("LD_PRELOAD", b.started[0][0])
        for env, _ in b.started[1:]:
            self.assertEqual(env["LD_PRELOAD"], "/nonexistent/libvgpu.so")
            self.assertTrue(env["VGPU_TURN_DIR"])
        lines = [s for s in said if s.startswith("- ")]
        self.assertEqual(len(lines), k - 1)
        self.assertIn("hooked / bare p50 1.30×", lines[-1])
        self.assertIn("hooked / bare p50 1.00×", lines[0])


class FakeTenants(bench_common.Bench):
    """bench_common.Bench whose tenants are answered from their command lines, without
    starting them: a matmul or training loop runs at a rate set by its SM limit (100 without
    one), a service gets requests every `think` + 4 ms (4 ms each, 30% longer for the
    tenants numbered in `slow`), a spin loop a fixed kernel rate; none while idle. Each
    tenant started is kept in `started`."""

    def __init__(self, lib, work, slow=()):
        super().__init__(lib, work)
        self.slow, self.started = slow, []

    def together(self, label, tenants, timeout=120):
        out = []
        for j, (env, argv) in enumerate(tenants):
            # What subprocess.Popen would refuse: every environment value a string.
            bad = [k for k, v in env.items() if not isinstance(v, str)]
            if bad:
                raise TypeError(f"tenant {j}: {bad} not strings")
            self.started.append((env, argv))
            if argv[0] != sys.executable:  # spin.cu's binary
                out.append({"kernels_per_s": 1000.0 * int(env.get("CUDA_DEVICE_SM_LIMIT", "100")) / 100})
                continue
            kind, seconds, idle = argv[2], float(argv[3]), idle_of(argv)
            rate = 50.0 * int(env.get("CUDA_DEVICE_SM_LIMIT", "100")) / 100
            bin_s = 0.05
            bins = [0.0 if any(a <= i * bin_s < z for a, z in idle) else rate
                    for i in range(int(seconds / bin_s))]
            r = {"kind": kind, "rate": rate, "bin_s": bin_s, "bins": bins, "count": int(sum(bins) * bin_s)}
            if kind == "infer":
                think = float(argv[argv.index("--think") + 1]) if "--think" in argv else 0.010
                lat = 4.0 * (1.3 if j in self.slow else 1.0)
                st = stamps_every(0.004 + think, seconds, idle)
                r.update(stamps=st, lat=[lat] * len(st), host_ms=[lat - 0.1] * len(st),
                         p50_ms=lat, p99_ms=lat)
            out.append(r)
        self.raw[label] = out
        self.raw[label + " (limiter stats)"] = [["device 0: limiter stats: (fake)"] for _ in tenants]
        return out


class FakeBusy:
    def __init__(self, t0_wall):
        pass

    def stop(self):
        return lambda t0, t1: 99.0


class FakeCli:
    """CliAt without the wait or the CLI: each call answered at once, `vgpu status --json`
    with one share record for the file asked about."""

    def __init__(self, vgpu, start, calls, env=None):
        self.out = []
        for t, argv in calls:
            text = ""
            if argv[0] == "status":
                key = abs(hash(argv[-1])) % (1 << 60)
                text = json.dumps({"devices": [{"turns": [{
                    "key": "%016x" % key, "this_container": True, "launch_us": 200,
                    "share": {"share_percent": 30, "ceiling_percent": 100, "priority": 1,
                              "utilization_percent": 30, "part_percent": 30, "busy": True,
                              "lent_ms": 0, "borrowed_ms": 0}}]}]})
            self.out.append((t, t, text))

    def join(self):
        return self.out


class EveryTableOnFakes(unittest.TestCase):
    """Each table of the bench runs to its last line on fake tenants: a name or key error
    found here costs no device time."""

    def setUp(self):
        self.saved = (elastic.Busy, elastic.CliAt, elastic.START_DELAY, priority.START_DELAY)
        elastic.Busy, elastic.CliAt = FakeBusy, FakeCli
        elastic.START_DELAY = priority.START_DELAY = 0.0
        self.work = tempfile.TemporaryDirectory()
        self.b = FakeTenants("/nonexistent/libvgpu.so", self.work.name)
        self.said = []

    def tearDown(self):
        elastic.Busy, elastic.CliAt, elastic.START_DELAY, priority.START_DELAY = self.saved
        self.work.cleanup()

    def test_tables_1_to_6_and_the_hook_cost(self):
        say = self.said.append
        elastic.table1(self.b, say, "/nonexistent/spin", "100", 1000.0, 50.0)
        elastic.table2(self.b, say, 50.0, "/nonexistent/vgpu")
        elastic.table3(self.b, say, 50.0, True, "/nonexistent/vgpu")
        priority.table4(self.b, say)
        vgpu = os.path.join(self.work.name, "vgpu")
        with open(vgpu, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(vgpu, 0o755)
        elastic.table5(self.b, say, vgpu)
        priority.table6(self.b, say)
        priority.hook_cost(self.b, say, priority.HOOK_COST_VARIANTS)
        text = "\n".join(self.said)
        for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6."):
            self.assertIn(heading, text)
        self.assertNotIn("failed", text)
        # Table 3 prints the records as `vgpu status` shows them while the four are busy.
        self.assertIn("`vgpu status --json` 1 s in, all four busy: 30% tenant (this file): part 30%", text)
        # Four alike at their limits: every share-mode phase of table 3 passes.
        rows = [l for l in self.said if l.startswith("| all busy") or " idle |" in l]
        self.assertEqual(len(rows), 5)
        self.assertTrue(all(l.endswith("| PASS | PASS |") for l in rows), rows)


class Environments(unittest.TestCase):
    def test_modes_set_what_hamis_variables_and_ours_mean(self):
        with tempfile.TemporaryDirectory() as work:
            b = bench_common.Bench("/lib/libvgpu.so", work)
            plain = b.env("plain")
            self.assertNotIn("LD_PRELOAD", plain)
            share = b.env("share", sm=30, priority=0, turns=b.turns())
            self.assertEqual(share["VGPU_SM_MODE"], "share")
            self.assertEqual(share["CUDA_DEVICE_SM_LIMIT"], "30")
            self.assertEqual(share["CUDA_TASK_PRIORITY"], "0")
            cap = b.env("cap", sm=70, turns=b.turns())
            self.assertNotIn("VGPU_SM_MODE", cap)
            self.assertNotEqual(share["CUDA_DEVICE_MEMORY_SHARED_CACHE"],
                                cap["CUDA_DEVICE_MEMORY_SHARED_CACHE"])


if __name__ == "__main__":
    random.seed(1)
    unittest.main()
