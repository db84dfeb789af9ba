//! Control-logic tests on the simulated clock and GPU.

use proptest::prelude::*;

use crate::sim::*;
use crate::{Admission, Limiter, LimiterConfig, Nanos, Policy};

fn cfg() -> LimiterConfig {
    LimiterConfig::default()
}

/// One process running `work` in a container limited to `limit`%, alone on a concurrent
/// engine: the world, the container's file and the process's id.
fn one_container(limit: u32, work: Workload) -> (World, SimTable, usize) {
    let mut w = World::new(GpuMode::Concurrent);
    let table = SimTable::new(limit);
    let id = w.add(cfg(), table.view(), work);
    (w, table, id)
}

/// Achieved share of one GPU-bound process running `work` under `limit`, measured over
/// `[t0, t1)`.
fn steady(limit: u32, work: Workload, t0: Nanos, t1: Nanos) -> (f64, World) {
    let (mut w, _table, id) = one_container(limit, work);
    w.run_until(t1);
    (w.gpu.busy_fraction(id, t0, t1), w)
}

fn assert_near(what: &str, got: f64, target: f64, tol_points: f64) {
    let (g, t) = (got * 100.0, target * 100.0);
    assert!(
        (g - t).abs() <= tol_points,
        "{what}: achieved {g:.2}% for target {t:.2}% (tolerance ±{tol_points} points)"
    );
}

#[test]
fn steady_state_within_two_points_short_and_long_kernels() {
    for dur in [50 * US, 5 * MS] {
        for limit in [10, 25, 50, 75] {
            let (got, w) = steady(limit, kernel_loop(dur), S, 6 * S);
            assert_near(
                &format!("limit {limit}, kernels of {dur} ns"),
                got,
                f64::from(limit) / 100.0,
                2.0,
            );
            // Markers are recycled: only the outstanding segments hold any.
            assert!(w.gpu.live_markers() <= 2 * cfg().max_outstanding + 2);
        }
    }
}

#[test]
fn events_are_batched_not_per_launch() {
    let (_, w) = steady(50, kernel_loop(50 * US), S, 3 * S);
    let stats = w.apps[0].limiter.stats();
    eprintln!("{} launches, {} markers", stats.launches, stats.markers);
    assert!(stats.launches > 10_000, "{stats:?}");
    // About 10 launches of 50 µs per 500 µs segment: far fewer markers than launches.
    assert!(
        stats.markers * 4 < stats.launches,
        "markers {} for {} launches",
        stats.markers,
        stats.launches
    );
}

#[test]
fn queued_work_stays_about_one_period_deep() {
    // Sample the queue depth of a 50% loop of 50 µs kernels many times.
    let (mut w, _table, _) = one_container(50, kernel_loop(50 * US));
    let mut worst = 0;
    for k in 1..2_000u64 {
        let t = S + k * 997 * US;
        w.run_until(t);
        worst = worst.max(w.gpu.stream_idle_at(1).saturating_sub(t));
    }
    // period 2 ms at 50% = 1 ms of work, plus a burst credit of 10 ms × 50% after waits
    // that overslept: never more than period + burst worth.
    assert!(worst <= 6 * MS, "queue reached {worst} ns");
}

#[test]
fn kernel_mix_change_still_holds_the_average() {
    let mut n = 0u64;
    let mixed: Workload = Box::new(move |_| {
        n += 1;
        // Alternate phases of short and long kernels.
        if (n / 2_000) % 2 == 0 {
            Step::Launch(50 * US)
        } else {
            Step::Launch(5 * MS)
        }
    });
    let (got, _) = steady(25, mixed, S, 20 * S);
    assert_near("mixed kernels", got, 0.25, 2.0);
}

#[test]
fn dynamic_limit_change_is_followed() {
    let (mut w, table, id) = one_container(25, kernel_loop(200 * US));
    w.run_until(4 * S);
    table.0.borrow_mut().sm_limit = 75;
    w.run_until(8 * S);
    assert_near("before", w.gpu.busy_fraction(id, S, 4 * S), 0.25, 2.0);
    assert_near("after", w.gpu.busy_fraction(id, 5 * S, 8 * S), 0.75, 2.0);
}

#[test]
fn bursty_load_below_the_limit_runs_at_full_speed() {
    // Bursts of 4 ms of GPU work, then sync and 16 ms of host work: 20% demand.
    let run = |limit: u32| {
        let (mut w, _table, id) = one_container(limit, bursty(100 * US, 40, 16 * MS));
        w.run_until(10 * S);
        (w.apps[id].syncs, w.gpu.busy_fraction(id, S, 10 * S))
    };
    let (free_cycles, free_util) = run(100);
    let (cycles, util) = run(50);
    assert!(
        (0.15..0.25).contains(&free_util),
        "unlimited demand {free_util}"
    );
    // The idle time after each burst must not be charged: throughput stays near unlimited.
    assert!(
        cycles as f64 >= 0.95 * free_cycles as f64,
        "{cycles} cycles limited vs {free_cycles} unlimited (util {util})"
    );
}

#[test]
fn bursty_load_above_the_limit_is_held() {
    // Bursts of 20 ms of work, then 20 ms of host work: 50% demand, limit 25.
    let (mut w, _table, id) = one_container(25, bursty(500 * US, 40, 20 * MS));
    w.run_until(12 * S);
    let got = w.gpu.busy_fraction(id, 2 * S, 12 * S);
    // Never above the limit. Below it by design: a pause earns at most `burst` (10 ms)
    // of credit, so one cycle takes 20 ms pause + (20 ms / 25% − 10 ms) ≈ 90 ms for
    // 20 ms of work, i.e. 22.2%.
    let model = 20.0 / (20.0 + 80.0 - 10.0);
    assert!(got <= 0.255, "above the limit: {got}");
    assert_near("bursty", got, model, 1.0);
}

#[test]
fn two_processes_share_one_container_limit() {
    let (mut w, table, a) = one_container(50, kernel_loop(50 * US));
    w.run_until(2 * S);
    // The second process starts later, with longer kernels.
    let b = w.add(cfg(), table.view(), kernel_loop(2 * MS));
    w.run_until(12 * S);
    let (ua, ub) = (
        w.gpu.busy_fraction(a, 5 * S, 12 * S),
        w.gpu.busy_fraction(b, 5 * S, 12 * S),
    );
    assert_near("container total", ua + ub, 0.50, 2.0);
    assert!(ua > 0.15 && ub > 0.15, "one process starved: {ua} {ub}");
    // Each publishes what it achieves.
    let slots = table.0.borrow().slots.clone();
    let published: u32 = slots.iter().sum();
    assert!((46..=54).contains(&published), "published {slots:?}");
}

/// A process that stops launching stops publishing: once its last share is older than
/// `peer_stale_after`, the other process budgets against the whole container limit again. A
/// publisher that leaves no time (an older library) keeps counting, as before.
#[test]
fn a_peer_that_stopped_launching_is_ignored_once_its_share_is_stale() {
    for untimed in [false, true] {
        let (mut w, table, a) = one_container(50, kernel_loop(100 * US));
        let b_view = table.view();
        table.0.borrow_mut().untimed[1] = untimed;
        // B launches for 3 s, then only does host work.
        let b = w.add(
            cfg(),
            b_view,
            Box::new(|t| {
                if t < 3 * S {
                    Step::Launch(MS)
                } else {
                    Step::Pause(10 * S)
                }
            }),
        );
        w.run_until(8 * S);
        let shared = w.gpu.busy_fraction(a, S, 3 * S) + w.gpu.busy_fraction(b, S, 3 * S);
        assert_near("container total while both launch", shared, 0.50, 2.0);
        let stale = table.0.borrow().slots[1];
        assert!(stale >= 10, "B's last published share: {stale}%");
        let alone = w.gpu.busy_fraction(a, 4 * S, 8 * S);
        if untimed {
            assert!(alone < 0.40, "an untimed share counts as fresh: {alone}");
        } else {
            assert_near("A after B stopped", alone, 0.50, 2.0);
        }
    }
}

#[test]
fn two_containers_at_30_and_70() {
    let (mut w, a, b) = thirty_seventy(GpuMode::Concurrent, false, 50 * US, 5 * MS);
    w.run_until(8 * S);
    assert_near("30% container", w.gpu.busy_fraction(a, S, 8 * S), 0.30, 2.0);
    assert_near("70% container", w.gpu.busy_fraction(b, S, 8 * S), 0.70, 2.0);
}

/// Two containers (two files) limited to 30% and 70%, on the turn board when `turns`,
/// running kernel loops of `dur_a` and `dur_b` on `mode`'s engine: the world and their ids.
fn thirty_seventy(mode: GpuMode, turns: bool, dur_a: Nanos, dur_b: Nanos) -> (World, usize, usize) {
    let mut w = World::new(mode);
    let (t30, t70) = (SimTable::new(30), SimTable::new(70));
    let node = SimNode::default();
    let (va, vb) = if turns {
        (t30.view_on_node(&node, 0xa), t70.view_on_node(&node, 0xb))
    } else {
        (t30.view(), t70.view())
    };
    let a = w.add(cfg(), va, kernel_loop(dur_a));
    let b = w.add(cfg(), vb, kernel_loop(dur_b));
    (w, a, b)
}

/// A configuration with the contention correction on.
fn correcting() -> LimiterConfig {
    LimiterConfig {
        contention_period: 500 * MS,
        ..cfg()
    }
}

/// Runs one 50% loop whose device accounting reports `scale` × its true busy share;
/// returns (true busy share, correction factor).
fn corrected(scale: f64, others_active: bool, c: LimiterConfig) -> (f64, f64) {
    let mut w = World::new(GpuMode::Concurrent);
    let table = SimTable::new(50);
    let view = table.view_with_device(&w, scale, others_active);
    let id = w.add(c, view, kernel_loop(100 * US));
    w.run_until(10 * S);
    (
        w.gpu.busy_fraction(id, 4 * S, 10 * S),
        w.apps[id].limiter.contention_correction(),
    )
}

#[test]
fn contention_correction_follows_the_devices_own_accounting() {
    // The events count 1/0.75 of what the device attributes to us (our work waited behind
    // another process's time slices): the device's view of our share is held at 50%.
    let (busy, factor) = corrected(0.75, true, correcting());
    assert!((factor - 0.75).abs() < 0.03, "factor {factor}");
    assert_near("device-accounted share", busy * 0.75, 0.50, 2.0);
}

#[test]
fn contention_correction_stays_off_alone_or_when_close() {
    // Alone on the device: no correction, whatever the device reports.
    let (busy, factor) = corrected(0.6, false, correcting());
    assert_eq!(factor, 1.0);
    assert_near("alone", busy, 0.50, 2.0);
    // Device and events agree within the threshold: no correction.
    let (busy, factor) = corrected(0.95, true, correcting());
    assert_eq!(factor, 1.0);
    assert_near("close", busy, 0.50, 2.0);
    // Never discounted below the floor.
    let (_, factor) = corrected(0.2, true, correcting());
    assert!((factor - 0.5).abs() < 0.01, "floor: {factor}");
    // Off (the default).
    let (busy, factor) = corrected(0.75, true, cfg());
    assert_eq!(factor, 1.0);
    assert_near("off", busy, 0.50, 2.0);
}

#[test]
fn policies() {
    let run = |policy: Policy, switch: i32| {
        let mut w = World::new(GpuMode::Concurrent);
        let table = SimTable::new(30);
        table.0.borrow_mut().utilization_switch = switch;
        let c = LimiterConfig { policy, ..cfg() };
        let id = w.add(c, table.view(), kernel_loop(100 * US));
        w.run_until(3 * S);
        (w.gpu.busy_fraction(id, S, 3 * S), w.gpu.timer_ops())
    };
    // The default holds the limit even when the monitor says the tenant is alone.
    for policy in [Policy::Default, Policy::Force] {
        for switch in [0, 1] {
            assert_near(
                &format!("{policy:?}/{switch}"),
                run(policy, switch).0,
                0.30,
                2.0,
            );
        }
    }
    // MONITOR follows the switch, like HAMi-core's default.
    assert_near("monitor/1", run(Policy::Monitor, 1).0, 0.30, 2.0);
    let (util, ops) = run(Policy::Monitor, 0);
    assert!(util > 0.99 && ops == 0, "monitor/0: {util} {ops}");
    let (util, ops) = run(Policy::Disable, 1);
    assert!(util > 0.99 && ops == 0, "disable: {util} {ops}");
}

#[test]
fn recent_kernel_blocks_launches_while_negative() {
    let (mut w, table, id) = one_container(50, kernel_loop(100 * US));
    w.run_until(2 * S);
    assert!(table.0.borrow().activity > 0, "activity is signalled");
    assert_eq!(
        table.0.borrow().recent_kernel,
        2,
        "activity marks recent_kernel"
    );
    table.0.borrow_mut().recent_kernel = -1;
    w.run_until(3 * S);
    table.0.borrow_mut().recent_kernel = 0;
    w.run_until(5 * S);
    // Nothing starts while blocked, apart from work queued before (≤ one period).
    let started = w.gpu.kernels_started(id, 2 * S + 5 * MS, 3 * S);
    assert_eq!(started, 0, "kernels started while blocked");
    // Launches resume within a poll interval and the limit still holds afterwards.
    assert!(w.gpu.kernels_started(id, 3 * S, 3 * S + 5 * MS) > 0);
    assert_near(
        "after unblock",
        w.gpu.busy_fraction(id, 3 * S + 500 * MS, 5 * S),
        0.5,
        2.0,
    );
}

#[test]
fn no_limit_is_a_pure_fast_path() {
    for limit in [0, 100] {
        let (mut w, table, id) = one_container(limit, kernel_loop(50 * US));
        w.run_until(S);
        assert_eq!(w.gpu.timer_ops(), 0, "timer used with limit {limit}");
        assert_eq!(
            table.0.borrow().writes,
            0,
            "shared writes with limit {limit}"
        );
        assert_eq!(w.apps[id].limiter.stats().waits, 0);
        assert!(w.gpu.busy_fraction(id, 0, S) > 0.99);
    }
}

#[test]
fn timer_failures_do_not_block_or_panic() {
    let (mut w, _table, id) = one_container(50, kernel_loop(100 * US));
    w.run_until(S);
    w.gpu.set_fail_records(true);
    w.run_until(2 * S);
    let stats = w.apps[id].limiter.stats();
    assert!(stats.timer_errors > 0);
    // With the learned cost, unmeasured launches are still paced by their estimate.
    assert_near(
        "estimate only",
        w.gpu.busy_fraction(id, 1100 * MS, 2 * S),
        0.5,
        3.0,
    );
    w.gpu.set_fail_records(false);
    w.run_until(4 * S);
    assert_near(
        "recovered",
        w.gpu.busy_fraction(id, 2500 * MS, 4 * S),
        0.5,
        2.0,
    );
}

#[test]
fn failed_launches_are_not_charged_and_keep_markers_consistent() {
    // Every 7th launch fails; some fail right after a segment was chained onto the
    // previous one's end marker, which must then stay alive for that segment.
    let (mut w, _table, id) = one_container(40, kernel_loop(100 * US));
    w.apps[id].fail_every = Some(7);
    w.run_until(4 * S);
    assert_near(
        "with failures",
        w.gpu.busy_fraction(id, S, 4 * S),
        0.40,
        2.0,
    );
}

#[test]
fn failed_launch_on_a_chained_segment_keeps_the_shared_marker() {
    let w = World::new(GpuMode::Concurrent);
    let table = SimTable::new(50);
    let mut lim = Limiter::new(cfg(), w.clock.clone(), w.timer(), table.view());
    let go = |lim: &mut Limiter<_, _, _>, stream: u32, t: Nanos, ok: bool| {
        w.clock.set(t);
        let Admission::Go(ticket) = lim.admit(stream) else {
            panic!("throttled at {t}")
        };
        if ok {
            w.gpu.enqueue(stream, t, MS, 0);
        }
        lim.launched(ticket, stream, ok);
    };
    go(&mut lim, 1, 0, true); // calibration launch, measured alone
    // Its end marker is reached a marker's latency after the kernel ends.
    let t1 = MS + 2 * MARKER_LATENCY;
    w.clock.set(t1);
    go(&mut lim, 1, t1, true); // cost known: a 1 ms segment, closed at once
    go(&mut lim, 1, t1 + 10 * US, false); // chains onto its end marker, then fails
    go(&mut lim, 2, t1 + 20 * US, true); // another stream closes the empty segment
    // The first stream's segment still completes and is measured.
    w.clock.set(3 * MS);
    go(&mut lim, 2, 3 * MS, true);
    w.clock.set(10 * MS);
    go(&mut lim, 2, 10 * MS, true);
    assert_eq!(lim.stats().segments, 4, "{:?}", lim.stats());
    assert!((lim.stats().busy_ns - 4e6).abs() < 1e3, "{:?}", lim.stats());
}

#[test]
fn first_launch_calibrates_before_queueing_more() {
    let w = World::new(GpuMode::Concurrent);
    let table = SimTable::new(50);
    let mut lim = Limiter::new(cfg(), w.clock.clone(), w.timer(), table.view());
    let Admission::Go(ticket) = lim.admit(1) else {
        panic!("first launch waits")
    };
    assert!(ticket.counted());
    w.gpu.enqueue(1, 0, 3 * MS, 0);
    lim.launched(ticket, 1, true);
    // The cost of a launch is unknown until the first one is measured.
    assert!(matches!(lim.admit(1), Admission::Wait(_)));
    w.clock.set(3 * MS);
    // Measured: 3 ms at 50% pays off at 6 ms (minus the burst credit).
    let mut t = 3 * MS;
    while let Admission::Wait(d) = lim.admit(1) {
        t += d;
        w.clock.set(t);
    }
    assert!(t <= 6 * MS, "waited until {t}");
}

#[test]
fn two_containers_on_one_serial_engine() {
    // One engine runs both processes' work in submission order, so time a process's
    // work waits behind the other's is charged to it (events measure wall time on the
    // GPU). Queues stay short, so the error is small, and never above the limit.
    let (mut w, a, b) = thirty_seventy(GpuMode::Serial, false, 50 * US, 500 * US);
    w.run_until(6 * S);
    let (ua, ub) = (
        w.gpu.busy_fraction(a, S, 6 * S),
        w.gpu.busy_fraction(b, S, 6 * S),
    );
    assert!(ua <= 0.305 && ub <= 0.705, "over the limit: {ua} {ub}");
    assert_near("30% container, serial engine", ua, 0.30, 3.0);
    assert_near("70% container, serial engine", ub, 0.70, 3.0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn any_limit_and_kernel_length_holds(
        limit in 5u32..=95,
        dur_us in 20u64..=8_000,
        oversleep_us in 0u64..=300,
    ) {
        let (mut w, _table, id) = one_container(limit, kernel_loop(dur_us * US));
        w.apps[id].max_oversleep = oversleep_us * US;
        w.run_until(5 * S);
        let got = w.gpu.busy_fraction(id, S, 5 * S) * 100.0;
        prop_assert!(
            (got - f64::from(limit)).abs() <= 2.0,
            "limit {} kernels {} µs oversleep {} µs: achieved {:.2}%",
            limit, dur_us, oversleep_us, got
        );
    }
}

/// Two containers (two files) at 30/70 with 47 µs kernel loops, on an engine that hands
/// the device to arriving work at once (what the H200 showed), with or without the turn
/// board; returns their achieved shares over [1 s, 6 s).
fn two_containers_preempting(turns: bool, dur: Nanos) -> (f64, f64, World) {
    let (mut w, a, b) = thirty_seventy(GpuMode::Preempting, turns, dur, dur);
    w.run_until(6 * S);
    (
        w.gpu.busy_fraction(a, S, 6 * S),
        w.gpu.busy_fraction(b, S, 6 * S),
        w,
    )
}

#[test]
fn time_slicing_between_containers_costs_the_larger_one_its_share() {
    // The model reproduces the H200's failure (there 29.8% / 52-54%): each tenant's events
    // count the other's slices as its own, so the 70% tenant falls well short. (Here the
    // 30% one loses too, ~23%: the model pushes its queue back as well.) Never above.
    let (ua, ub, _) = two_containers_preempting(false, 47 * US);
    eprintln!("without turns: {ua:.3} {ub:.3}");
    assert!(ua <= 0.305 && ub <= 0.705, "over the limit: {ua} {ub}");
    assert!(
        ub < 0.62,
        "70% container got {ub:.3}: the model shows no contention"
    );
}

#[test]
fn two_containers_taking_turns_split_30_70() {
    // 5 ms launches stretch the cycle to its cap, 160 ms (a 48 ms window for 30%); with a
    // cap of 80 ms this model gave 18% for the 30% tenant.
    for dur in [47 * US, 500 * US, 2 * MS, 5 * MS] {
        let (ua, ub, w) = two_containers_preempting(true, dur);
        eprintln!("with turns, kernels of {dur} ns: {ua:.3} {ub:.3}");
        assert!(w.apps[0].limiter.turn().is_some() && w.apps[1].limiter.turn().is_some());
        assert!(ua <= 0.305 && ub <= 0.705, "over the limit: {ua} {ub}");
        assert_near("30% container, turns", ua, 0.30, 3.0);
        assert_near("70% container, turns", ub, 0.70, 3.0);
    }
}

#[test]
fn turn_layout_is_shared_and_proportional() {
    use crate::{Turn, TurnTenant};
    let t = |key, pct: u32, launch_ns| TurnTenant {
        key,
        part_bp: pct * 100,
        launch_ns,
    };
    let all = [t(9, 70, 47 * US), t(4, 30, 47 * US)];
    let a = Turn::layout(4, &all, 10 * MS).unwrap();
    let b = Turn::layout(9, &all, 10 * MS).unwrap();
    assert_eq!((a.cycle, a.offset, a.width), (10 * MS, 0, 3 * MS));
    assert_eq!((b.cycle, b.offset, b.width), (10 * MS, 3 * MS, 7 * MS));
    // Alone, or not on the board: no turns.
    assert_eq!(Turn::layout(4, &[t(4, 30, 0)], 10 * MS), None);
    assert_eq!(Turn::layout(5, &all, 10 * MS), None);
    // Oversubscribed (70 + 70): scaled to the cycle, no overlap.
    let o = [t(1, 70, 0), t(2, 70, 0)];
    let (x, y) = (
        Turn::layout(1, &o, 10 * MS).unwrap(),
        Turn::layout(2, &o, 10 * MS).unwrap(),
    );
    assert_eq!((x.width, y.offset, y.width), (5 * MS, 5 * MS, 5 * MS));
    // Long launches stretch the cycle so that each window holds 16 of them, in powers of
    // two of the minimum (500 µs × 16 / 0.3 = 26.7 ms → 40 ms); both tenants agree on it,
    // and a small drift of the launch length does not change it.
    let long = [t(4, 30, 500 * US), t(9, 70, 47 * US)];
    let (la, lb) = (
        Turn::layout(4, &long, 10 * MS).unwrap(),
        Turn::layout(9, &long, 10 * MS).unwrap(),
    );
    assert_eq!(la.cycle, 40 * MS);
    assert_eq!((lb.cycle, lb.offset), (la.cycle, la.width));
    let drifted = [t(4, 30, 560 * US), t(9, 70, 60 * US)];
    assert_eq!(Turn::layout(9, &drifted, 10 * MS).unwrap(), lb);
    // At most 8 × the minimum (160 ms for the default 20 ms).
    let capped = [t(4, 30, 5 * MS), t(9, 70, 0)];
    assert_eq!(Turn::layout(4, &capped, 20 * MS).unwrap().cycle, 160 * MS);
    // Share mode: every window 250 us on top of its part (cycle 40 ms for 16 launches of
    // 200 us in the 10% window), the windows still tiling it; a 160th of a longer cycle.
    let four: Vec<TurnTenant> = (1..=4).map(|k| t(k, 10 * k as u32, 200 * US)).collect();
    let shared: Vec<_> = (1..=4)
        .map(|k| Turn::layout_shared(k, &four, 20 * MS).unwrap())
        .collect();
    let widths: Vec<Nanos> = shared.iter().map(|t| t.width).collect();
    assert_eq!(widths, [4_150 * US, 8_050 * US, 11_950 * US, 15_850 * US]);
    assert!(
        shared
            .windows(2)
            .all(|p| p[1].offset == p[0].offset + p[0].width)
    );
    assert_eq!(shared[3].offset + shared[3].width, 40 * MS);
    // The allowance is time: 250 us also in the shortest cycle (20 ms, three at 20/30/50 of
    // 50 us launches), and a 160th of a cycle long launches stretched (160 ms: 1 ms).
    let widths = |tenants: &[TurnTenant], min| -> Vec<Nanos> {
        tenants
            .iter()
            .map(|t| Turn::layout_shared(t.key, tenants, min).unwrap().width)
            .collect()
    };
    let three = [t(1, 20, 50 * US), t(2, 30, 50 * US), t(3, 50, 50 * US)];
    assert_eq!(
        widths(&three, 20 * MS),
        [4_100 * US, 6_025 * US, 9_875 * US]
    );
    let long = [t(1, 20, 5 * MS), t(2, 80, 5 * MS)];
    assert_eq!(widths(&long, 20 * MS), [32_600 * US, 127_400 * US]);
    // Open from its offset for its width in every cycle, from the lead-in before (at most
    // an eighth of the window: 875 us here).
    assert!(b.is_open(20 * MS + 3 * MS, 0) && b.is_open(20 * MS + 10 * MS - 1, 0));
    assert!(!b.is_open(20 * MS + 10 * MS, 0) && !b.is_open(20 * MS + 3 * MS - 1, 0));
    assert!(b.is_open(20 * MS + 3 * MS - 800 * US, MS));
    assert!(!b.is_open(20 * MS + 3 * MS - 900 * US, MS));
    assert!(a.is_open(30 * MS, 0) && !a.is_open(33 * MS, 0));
    // Admission: inside the window while queued work ends in it; else the next window.
    assert_eq!(
        b.admits(20 * MS + 4 * MS, (24 * MS) as f64, 100.0 * US as f64, 0),
        Ok(())
    );
    assert_eq!(
        b.admits(20 * MS + 4 * MS, (30 * MS) as f64, 100.0 * US as f64, 0),
        Err(9 * MS),
        "queue would run past the window"
    );
    assert_eq!(
        b.admits(20 * MS + MS, (21 * MS) as f64, 0.0, 0),
        Err(2 * MS)
    );
    // Work longer than the window goes when nothing is queued.
    assert_eq!(a.admits(0, 0.0, (5 * MS) as f64, 0), Ok(()));
    assert_eq!(
        a.admits(MS, (2 * MS) as f64, (5 * MS) as f64, 0),
        Err(9 * MS)
    );
    // A lead-in opens the window early (at most an eighth of it): b's opens at 23 ms.
    let lead = 150 * US;
    assert_eq!(
        b.admits(23 * MS - lead, (22 * MS) as f64, 0.0, lead),
        Ok(())
    );
    assert_eq!(
        b.admits(23 * MS - lead - 1, (22 * MS) as f64, 0.0, lead),
        Err(1)
    );
    assert_eq!(
        b.admits(21 * MS, (21 * MS) as f64, 0.0, lead),
        Err(2 * MS - lead)
    );
    // The last tenant's lead-in reaches into the next cycle: a's window opens at 10 ms.
    assert_eq!(
        a.admits(10 * MS - 100 * US, (9 * MS) as f64, 0.0, lead),
        Ok(())
    );
}

// ---------------------------------------------------------------------------------------
// The power share (crate::power) on a GPU with a power controller.

/// The H200's bf16 matmul loop as measured (docs/sm-limit.md): 125 W idle, +800 W per
/// busy second at 1980 MHz, a 700 W limit; unlimited it runs at ~72% of the clock.
/// Power above idle grows as clock^1.07 and throughput as clock^0.57 (from the H200 runs:
/// 1.39× the power and 1.19× the throughput per busy second at 1980 vs ~1450 MHz).
const H200_MATMUL: PowerModel = PowerModel {
    idle_w: 125.0,
    busy_w: 800.0,
    limit_w: 700.0,
    alpha: 1.07,
    beta: 0.57,
};

/// A compute loop that never reaches the limit (the H200's spin loop: ~475 W flat out).
const COOL_LOOP: PowerModel = PowerModel {
    busy_w: 350.0,
    ..H200_MATMUL
};

/// Kernels of a loop of `dur` launched in `[t0, t1)` under `limit` (0 = unlimited) with the
/// power exponent `k`, on a GPU modelled by `model`. The host first works for `lead_idle`
/// (the time from context creation to the first launch); returns the launches and the
/// limiter's last power state.
fn powered(
    model: PowerModel,
    limit: u32,
    k: f64,
    dur: Nanos,
    lead_idle: Nanos,
    (t0, t1): (Nanos, Nanos),
) -> (usize, Option<crate::power::PowerState>) {
    let mut w = World::with_power(GpuMode::Concurrent, model);
    let table = SimTable::new(limit);
    let view = table.view_with_power(&w);
    let cfg = LimiterConfig {
        power_exponent: k,
        ..cfg()
    };
    let id = w.add(cfg, view, synced_loop_after(lead_idle, dur));
    w.run_until(t1);
    (
        w.gpu.kernels_started(id, t0, t1),
        w.apps[id].limiter.power_state(),
    )
}

/// Host work for `lead_idle`, then a loop of `dur` kernels with a sync every 8 launches:
/// that bounds the queue, as the driver's launch queue does (the simulated GPU fixes a
/// kernel's clock when it is queued, so an unbounded queue would run at the clock of long
/// ago).
fn synced_loop_after(lead_idle: Nanos, dur: Nanos) -> Workload {
    let mut started = lead_idle == 0;
    let mut i = 0u32;
    Box::new(move |_| {
        if !started {
            started = true;
            return Step::Pause(lead_idle);
        }
        i += 1;
        if i % 9 == 0 {
            Step::Sync
        } else {
            Step::Launch(dur)
        }
    })
}

const SETTLED: (Nanos, Nanos) = (3 * S, 7 * S);

/// For each of `limits`: the throughput of a loop of `dur` kernels under it, as a fraction
/// of the unlimited loop's (both after 500 ms of host work, counted over [`SETTLED`]), with
/// the limiter's last power state.
fn of_unlimited(
    model: PowerModel,
    k: f64,
    dur: Nanos,
    limits: &[u32],
) -> Vec<(u32, f64, Option<crate::power::PowerState>)> {
    let (unlimited, _) = powered(model, 0, k, dur, 500 * MS, SETTLED);
    limits
        .iter()
        .map(|&limit| {
            let (n, st) = powered(model, limit, k, dur, 500 * MS, SETTLED);
            (limit, n as f64 / unlimited as f64, st)
        })
        .collect()
}

#[test]
fn power_capped_work_gets_its_limit_of_throughput_not_of_time() {
    for dur in [50 * US, 5 * MS] {
        for (limit, got, st) in of_unlimited(H200_MATMUL, 0.5, dur, &[10, 25, 50, 75]) {
            eprintln!(
                "{dur} ns, limit {limit}: {:.1}% of unlimited, {st:?}",
                got * 100.0
            );
            assert_near(
                &format!("throughput, limit {limit}, kernels of {dur} ns"),
                got,
                f64::from(limit) / 100.0,
                5.0,
            );
        }
    }
}

#[test]
fn time_alone_overshoots_power_capped_work_as_on_the_h200() {
    // The failure the power share fixes (H200: +9.6 points at 50, +9.8 at 75).
    for (limit, got, st) in of_unlimited(H200_MATMUL, 0.0, 50 * US, &[50, 75]) {
        let over = 100.0 * got - f64::from(limit);
        assert!(over > 5.0, "limit {limit}: only {over:+.1} points ({st:?})");
        assert_eq!(st, None, "exponent 0: no power share at all");
    }
}

#[test]
fn work_under_the_power_limit_keeps_the_time_share() {
    for (limit, got, st) in of_unlimited(COOL_LOOP, 0.5, 50 * US, &[10, 50, 75]) {
        let st = st.expect("power samples");
        assert_eq!(st.scale, 1.0, "limit {limit}: {st:?}");
        assert!(
            st.idle_watts.is_some_and(|w| (w - 125.0).abs() < 15.0),
            "{st:?}"
        );
        assert_near(
            &format!("limit {limit}"),
            got,
            f64::from(limit) / 100.0,
            2.0,
        );
    }
}

#[test]
fn textbook_dvfs_is_held_closely() {
    // Power ∝ clock², throughput ∝ clock: the case the default exponent ½ is exact for.
    let model = PowerModel {
        alpha: 2.0,
        beta: 1.0,
        ..H200_MATMUL
    };
    for (limit, got, st) in of_unlimited(model, 0.5, 50 * US, &[25, 50, 75]) {
        assert_near(
            &format!("limit {limit} ({st:?})"),
            got,
            f64::from(limit) / 100.0,
            3.0,
        );
    }
}

#[test]
fn without_an_idle_span_only_time_is_limited_until_the_host_pauses() {
    // Launches from the first instant: no idle power, so no scaling (the time share, as
    // before the power share existed).
    let (_, st) = powered(H200_MATMUL, 50, 0.5, 50 * US, 0, SETTLED);
    let st = st.expect("samples");
    assert_eq!((st.idle_watts, st.scale), (None, 1.0), "{st:?}");

    // A pause of the host mid-run measures it, and the share applies from then on.
    let mut w = World::with_power(GpuMode::Concurrent, H200_MATMUL);
    let table = SimTable::new(50);
    let view = table.view_with_power(&w);
    let mut i = 0u32;
    let work: Workload = Box::new(move |t| {
        i += 1;
        if (S..S + 600 * MS).contains(&t) {
            Step::Pause(S + 600 * MS - t)
        } else if i % 9 == 0 {
            Step::Sync
        } else {
            Step::Launch(50 * US)
        }
    });
    let id = w.add(cfg(), view, work);
    w.run_until(S);
    assert_eq!(w.apps[id].limiter.power_state().unwrap().idle_watts, None);
    w.run_until(5 * S);
    let st = w.apps[id].limiter.power_state().unwrap();
    assert!(
        st.idle_watts.is_some_and(|i| (i - 125.0).abs() < 20.0),
        "{st:?}"
    );
    assert!(st.scale < 0.9, "{st:?}");
}

#[test]
fn two_containers_on_a_power_capped_gpu_still_split_30_70() {
    // Together they keep the GPU busy, so it runs power-capped as when unlimited: each
    // one's power per busy second falls to the budget and the scale returns to 1; the split
    // is the time split of the capped throughput.
    let dur = 47 * US;
    let (unlimited, _) = powered(H200_MATMUL, 0, 0.5, dur, 500 * MS, SETTLED);
    let mut w = World::with_power(GpuMode::Preempting, H200_MATMUL);
    let (t30, t70) = (SimTable::new(30), SimTable::new(70));
    let node = SimNode::default();
    let mut ids = Vec::new();
    for (table, key) in [(&t30, 0xa), (&t70, 0xb)] {
        let view = table.view_on_node(&node, key).powered(&w);
        ids.push(w.add(cfg(), view, synced_loop_after(500 * MS, dur)));
    }
    w.run_until(SETTLED.1);
    for (id, want) in ids.into_iter().zip([0.30, 0.70]) {
        let got = w.gpu.kernels_started(id, SETTLED.0, SETTLED.1) as f64 / unlimited as f64;
        let st = w.apps[id].limiter.power_state();
        assert!(w.apps[id].limiter.turn().is_some());
        assert_near(&format!("{want} container ({st:?})"), got, want, 5.0);
    }
}

#[test]
fn a_pause_is_not_charged_as_gpu_time_when_work_resumes() {
    // A 30% process runs 100 us kernels, synchronizes and pauses 3 s (the segment that
    // bracketed its last launches stays open: nothing closes it before the next launch),
    // then resumes. The end marker recorded at resume spans the pause, and it is not
    // complete right after its record, so the pause was charged as GPU time (the H200,
    // 2026-12-01: a 30% training loop paused 3 s was charged 3.2 s and made one step in
    // 15 s beside idle inference).
    let mut w = World::new(GpuMode::Serial);
    let (mut i, pause) = (0u64, (S, 4 * S));
    w.add(
        cfg(),
        SimTable::new(30).view(),
        Box::new(move |t| {
            i += 1;
            if (pause.0..pause.1).contains(&t) {
                Step::Pause(pause.1 - t)
            } else if i % 50 == 0 {
                Step::Sync
            } else {
                Step::Launch(100 * US)
            }
        }),
    );
    w.run_until(5 * S);
    let before = w.gpu.busy_fraction(0, S / 2, S);
    let after = w.gpu.busy_fraction(0, 4 * S + 100 * MS, 5 * S);
    assert_near("before the pause", before, 0.30, 2.0);
    assert_near("after the pause", after, 0.30, 2.0);
}
