//! Share mode on the simulated clock and GPU: lending idle time, taking it back, priority,
//! several tenants, dead and hostile records, live changes.

use crate::traits::Clock;
use std::cell::RefCell;
use std::rc::Rc;

use crate::sim::*;
use crate::{LimiterConfig, Nanos, ShareClaim, ShareTenant, SmMode};

fn share_cfg(ceiling_pct: u32, priority: i32) -> LimiterConfig {
    LimiterConfig {
        mode: SmMode::Share,
        ceiling_pct,
        priority,
        ..LimiterConfig::default()
    }
}

/// A world whose containers all share one board.
fn on_one_board(mode: GpuMode) -> (World, SimShares) {
    (World::new(mode), SimShares::default())
}

/// Adds a container limited to `sm_pct` (its share), best effort at 100% ceiling, that
/// publishes on `board` as `key`; returns its id.
fn tenant(w: &mut World, board: &SimShares, sm_pct: u32, key: u64, work: Workload) -> usize {
    w.add(
        share_cfg(100, 1),
        SimTable::new(sm_pct).view_sharing(board, key),
        work,
    )
}

/// The shares of the four-tenant cases (the H200's table 3).
const FOUR_SHARES: [u32; 4] = [10, 20, 30, 40];

/// Adds four tenants at [`FOUR_SHARES`] publishing as 0x10.., tenant `i` running `work(i)`.
fn four_tenants(
    w: &mut World,
    board: &SimShares,
    mut work: impl FnMut(usize) -> Workload,
) -> Vec<usize> {
    (0..FOUR_SHARES.len())
        .map(|i| tenant(w, board, FOUR_SHARES[i], 0x10 + i as u64, work(i)))
        .collect()
}

/// A record another container (dead, hostile or busy) left on the board: always busy at
/// 50 µs launches, ceiling 100%.
fn record(
    key: u64,
    share_pct: u32,
    priority: i32,
    busy_until: Nanos,
    heartbeat: Nanos,
) -> ShareTenant {
    ShareTenant {
        key,
        claim: ShareClaim {
            share_pct,
            ceiling_pct: 100,
            priority,
        },
        launch_ns: 50 * US,
        busy_until,
        heartbeat,
        util_pct: 100,
    }
}

/// Each busy tenant's part of the GPU time the device delivered in a phase is at least its
/// share of the busy tenants' shares, within `tol` points (what the H200's table 3 asks:
/// the edges of the turns cost the device some time, and a small share must not bear more
/// of that than a large one). `got[i]`: tenant `i`'s busy fraction; `idle`: the idle one.
fn assert_parts_of_delivered(what: &str, got: &[f64], idle: Option<usize>, tol: f64) {
    let delivered: f64 = got.iter().sum();
    let due: f64 = (0..got.len())
        .filter(|&i| Some(i) != idle)
        .map(|i| f64::from(FOUR_SHARES[i]))
        .sum();
    for (i, &u) in got.iter().enumerate() {
        if Some(i) == idle {
            continue;
        }
        let (part, fair) = (
            100.0 * u / delivered,
            100.0 * f64::from(FOUR_SHARES[i]) / due,
        );
        assert!(
            part >= fair - tol,
            "{what}: tenant {i} ({}%) got {part:.2}% of the delivered time, its part is {fair:.2}%",
            FOUR_SHARES[i]
        );
    }
}

/// A kernel loop that goes idle (no launches) during each `[from, to)`.
fn loop_with_idle(dur: Nanos, idle: Vec<(Nanos, Nanos)>) -> Workload {
    Box::new(
        move |t| match idle.iter().find(|(a, b)| (*a..*b).contains(&t)) {
            Some(&(_, b)) => Step::Pause(b - t),
            None => Step::Launch(dur),
        },
    )
}

/// Requests of `kernels` launches of `dur` (with `host` of host work after each launch,
/// when given: a launch-bound request, batch-1 inference), each request waited for at its
/// end, `think` apart; each request's latency (first launch asked to
/// completion) is pushed to `lat`.
fn requests(
    kernels: u32,
    dur: Nanos,
    host: Option<Nanos>,
    think: Nanos,
    lat: Rc<RefCell<Vec<Nanos>>>,
) -> Workload {
    let steps = if host.is_some() { 2 * kernels } else { kernels };
    let (mut i, mut start) = (0u32, 0);
    Box::new(move |t| {
        i += 1;
        match i {
            1 => {
                start = t;
                Step::Launch(dur)
            }
            n if n <= steps => match host {
                Some(host) if n % 2 == 0 => Step::Pause(host),
                _ => Step::Launch(dur),
            },
            n if n == steps + 1 => Step::Sync,
            _ => {
                lat.borrow_mut().push(t - start);
                i = 0;
                Step::Pause(think)
            }
        }
    })
}

fn percentile(v: &[Nanos], p: f64) -> Nanos {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Busy fraction of `owner` in bins of `bin` over `[t0, t1)`.
fn series(w: &World, owner: usize, t0: Nanos, t1: Nanos, bin: Nanos) -> Vec<f64> {
    (t0..t1 - bin + 1)
        .step_by(bin as usize)
        .map(|t| w.gpu.busy_fraction(owner, t, t + bin))
        .collect()
}

#[test]
fn idle_time_is_lent_and_taken_back_within_250_ms() {
    // 30/70 on an engine that time-slices like the H200; the 70% container is idle from
    // 3 s to 5 s. Unlimited, a kernel loop keeps the GPU busy all the time (1.0).
    for dur in [47 * US, 500 * US, 2 * MS] {
        let (mut w, board) = on_one_board(GpuMode::Preempting);
        let a = tenant(&mut w, &board, 30, 0xa, kernel_loop(dur));
        let b = tenant(
            &mut w,
            &board,
            70,
            0xb,
            loop_with_idle(dur, vec![(3 * S, 5 * S)]),
        );
        w.run_until(7 * S);
        let (ua, ub) = (
            w.gpu.busy_fraction(a, S, 3 * S),
            w.gpu.busy_fraction(b, S, 3 * S),
        );
        eprintln!("{dur} ns kernels, both busy: {ua:.3} {ub:.3}");
        assert!(
            (ua - 0.30).abs() <= 0.03 && (ub - 0.70).abs() <= 0.03,
            "30/70: {ua} {ub}"
        );
        // Shares are defined over whole turn cycles (20 ms, stretched to 160 ms for 2 ms
        // launches): bins of 200 ms, or two cycles when longer.
        let cycle = w.apps[a].limiter.turn().expect("both busy: turns").cycle;
        let bin = (2 * cycle).max(200 * MS);
        let lent = series(&w, a, 3 * S + 50 * MS, 5 * S, bin);
        eprintln!("  30% while lent: {:?}", &lent[..4]);
        assert!(
            lent.iter().all(|&u| u >= 0.90),
            "30% container, bins from 50 ms after the 70% went idle: {lent:?}"
        );
        let back = series(&w, b, 5 * S + 50 * MS, 7 * S, bin);
        eprintln!("  70% after resuming: {:?}", &back[..4]);
        assert!(
            back.iter().all(|&u| u >= 0.65),
            "70% container, bins from 50 ms after resuming: {back:?}"
        );
        let ua2 = w.gpu.busy_fraction(a, 5 * S + 250 * MS, 7 * S);
        assert!((ua2 - 0.30).abs() <= 0.03, "30% container gave back: {ua2}");
        let report = board.report(0xa).expect("published");
        assert!(report.borrowed_ns > S, "borrowed {report:?}");
        assert!(board.report(0xb).unwrap().lent_ns > S / 2);
    }
}

#[test]
fn four_tenants_with_one_idle_at_a_time_keep_their_shares_and_the_gpu_busy() {
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let ids = four_tenants(&mut w, &board, |i| {
        let idle = vec![((i as u64 + 2) * S, (i as u64 + 3) * S)];
        loop_with_idle(200 * US, idle)
    });
    w.run_until(7 * S);
    // After a second of warm-up, phase 0: all busy; phase k: tenant k-1 idle. The first
    // 250 ms of each phase are not counted. Whole launches fit a window, so each busy
    // tenant may lose up to one launch per window against its share (1.5 points here).
    for phase in 0..5u64 {
        let (t0, t1) = ((phase + 1) * S + 250 * MS, (phase + 2) * S);
        let mut device = 0.0;
        let mut got = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let u = w.gpu.busy_fraction(id, t0, t1);
            device += u;
            got.push(u);
            if phase != i as u64 + 1 {
                assert!(
                    u >= f64::from(FOUR_SHARES[i]) / 100.0 - 0.015,
                    "phase {phase}: tenant {i} ({}%) got {u:.3}",
                    FOUR_SHARES[i]
                );
            }
        }
        eprintln!("phase {phase}: {got:.3?} device busy {device:.3}");
        assert!(device >= 0.95, "phase {phase}: device busy {device:.3}");
        // Whole launches fit a window: 200 us in a 20 ms cycle moves a part by up to a
        // point, so within 0.6 (the 10% tenant was 0.7 under without the edge allowance).
        let idle = (phase as usize).checked_sub(1);
        assert_parts_of_delivered(&format!("phase {phase}"), &got, idle, 0.6);
    }
}

/// Latencies of requests of 50 × 100 µs every 10 ms, next to a best-effort kernel loop
/// (200 µs kernels) or alone; returns them with the loop's busy fraction.
fn service_beside_training(with_training: bool, share_mode: bool) -> (Vec<Nanos>, f64) {
    let (mut w, board) = on_one_board(GpuMode::Serial);
    let lat = Rc::new(RefCell::new(Vec::new()));
    let (cfg_hi, cfg_lo) = if share_mode {
        (share_cfg(100, 0), share_cfg(100, 1))
    } else {
        (LimiterConfig::default(), LimiterConfig::default())
    };
    w.add(
        cfg_hi,
        SimTable::new(0).view_sharing(&board, 0x1),
        requests(50, 100 * US, None, 10 * MS, lat.clone()),
    );
    let lo = with_training.then(|| {
        w.add(
            cfg_lo,
            SimTable::new(0).view_sharing(&board, 0x2),
            kernel_loop(200 * US),
        )
    });
    w.run_until(5 * S);
    let busy = lo.map_or(0.0, |id| w.gpu.busy_fraction(id, S, 5 * S));
    // The first second is warm-up (when there is more than that).
    let lat: Vec<Nanos> = lat.borrow().clone();
    let lat = if lat.len() > 40 {
        lat[20..].to_vec()
    } else {
        lat
    };
    (lat, busy)
}

#[test]
fn priority_holds_best_effort_launches_while_the_service_has_work() {
    let (alone, _) = service_beside_training(false, false);
    let (shared, busy) = service_beside_training(true, true);
    let (p50a, p99a) = (percentile(&alone, 0.5), percentile(&alone, 0.99));
    let (p50, p99) = (percentile(&shared, 0.5), percentile(&shared, 0.99));
    eprintln!(
        "alone p50 {p50a} p99 {p99a}; beside training p50 {p50} p99 {p99}; training {busy:.3}"
    );
    assert!(
        p50 as f64 <= 1.25 * p50a as f64,
        "p50 {p50} vs alone {p50a}"
    );
    assert!(
        p99 as f64 <= 1.25 * p99a as f64,
        "p99 {p99} vs alone {p99a}"
    );
    // Alone the training loop keeps the GPU busy; it keeps at least half of that.
    assert!(busy >= 0.5, "best effort got {busy:.3}");
}

#[test]
fn without_share_mode_the_training_loop_delays_the_service() {
    // The same pair with no mode set: nothing is held (both unlimited, the launch path is
    // untouched), and on a first-come engine the service waits behind the training queue.
    let (alone, _) = service_beside_training(false, false);
    let (plain, _) = service_beside_training(true, false);
    // (The model's driver queue has no bound: the service may not finish a request.)
    assert!(
        plain.len() < alone.len() / 2
            || percentile(&plain, 0.5) as f64 > 1.25 * percentile(&alone, 0.5) as f64,
        "the model shows no contention"
    );
}

#[test]
fn a_dead_tenants_claim_expires_within_its_heartbeat_age() {
    // A high-priority tenant died (or a hostile one wrote once) claiming work forever.
    let (mut w, board) = on_one_board(GpuMode::Concurrent);
    board.put(record(0x99, 100, 0, Nanos::MAX, 0));
    let id = tenant(&mut w, &board, 0, 0x1, kernel_loop(100 * US));
    w.run_until(2 * S);
    let held = w.gpu.busy_fraction(id, 0, 250 * MS);
    let after = w.gpu.busy_fraction(id, 400 * MS, 2 * S);
    eprintln!("held {held:.3}, after expiry {after:.3}");
    assert!(held < 0.01, "held while the claim is fresh: {held}");
    assert!(after >= 0.95, "after the heartbeat aged out: {after}");
}

#[test]
fn a_tenant_that_dies_in_its_turn_hands_it_back() {
    // Two busy containers take turns; the 70% one stops launching for good (its process
    // died) in the middle of its window: the 30% one gets the GPU within 250 ms.
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let a = tenant(&mut w, &board, 30, 0xa, kernel_loop(500 * US));
    tenant(
        &mut w,
        &board,
        70,
        0xb,
        loop_with_idle(500 * US, vec![(2 * S + 13 * MS, Nanos::MAX)]),
    );
    w.run_until(4 * S);
    let after = series(&w, a, 2 * S + 50 * MS, 4 * S, 200 * MS);
    assert!(after.iter().all(|&u| u >= 0.9), "{after:?}");
}

#[test]
fn hostile_records_cannot_take_the_guarantee() {
    // A record claiming the whole GPU at the highest priority, always busy, kept fresh.
    let (mut w, board) = on_one_board(GpuMode::Concurrent);
    let id = tenant(&mut w, &board, 30, 0x1, kernel_loop(100 * US));
    let mut t = 0;
    while t < 3 * S {
        board.put(record(0x66, 100, i32::MIN, Nanos::MAX, t));
        t += 100 * MS;
        w.run_until(t);
    }
    let u = w.gpu.busy_fraction(id, S, 3 * S);
    eprintln!("guarantee next to a hostile record: {u:.3}");
    // Believed, the claim would leave 30/130 = 23%; the guarantee holds, less the turn
    // windows' edge loss of whole launches (2-3 points here).
    assert!((0.27..=0.31).contains(&u), "{u}");
}

#[test]
fn alone_a_container_borrows_up_to_its_ceiling() {
    let (mut w, board) = on_one_board(GpuMode::Concurrent);
    let id = w.add(
        share_cfg(60, 1),
        SimTable::new(20).view_sharing(&board, 0x1),
        kernel_loop(100 * US),
    );
    // Without a board (no turn directory) it is alone too.
    let lone = w.add(
        share_cfg(45, 1),
        SimTable::new(20).view(),
        kernel_loop(100 * US),
    );
    w.run_until(3 * S);
    let (u, l) = (
        w.gpu.busy_fraction(id, S, 3 * S),
        w.gpu.busy_fraction(lone, S, 3 * S),
    );
    assert!(
        (u - 0.60).abs() <= 0.02 && (l - 0.45).abs() <= 0.02,
        "{u} {l}"
    );
}

#[test]
fn live_share_and_priority_changes_apply_within_a_second() {
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let (ta, tb) = (SimTable::new(30), SimTable::new(70));
    let a = w.add(
        share_cfg(100, 1),
        ta.view_sharing(&board, 0xa),
        kernel_loop(100 * US),
    );
    let b = w.add(
        share_cfg(100, 1),
        tb.view_sharing(&board, 0xb),
        kernel_loop(100 * US),
    );
    w.run_until(2 * S);
    // `vgpu set-limit --sm`: 30/70 becomes 60/40.
    ta.0.borrow_mut().sm_limit = 60;
    tb.0.borrow_mut().sm_limit = 40;
    w.run_until(4 * S);
    let (ua, ub) = (
        w.gpu.busy_fraction(a, 3 * S, 4 * S),
        w.gpu.busy_fraction(b, 3 * S, 4 * S),
    );
    assert!(
        (ua - 0.60).abs() <= 0.03 && (ub - 0.40).abs() <= 0.03,
        "{ua} {ub}"
    );
    // Both best effort; then `a` becomes the more urgent one: it takes everything.
    ta.0.borrow_mut().sm_limit = 0;
    tb.0.borrow_mut().sm_limit = 0;
    ta.0.borrow_mut().priority = Some(0);
    w.run_until(6 * S);
    let (ua, ub) = (
        w.gpu.busy_fraction(a, 5 * S, 6 * S),
        w.gpu.busy_fraction(b, 5 * S, 6 * S),
    );
    assert!(ua >= 0.95 && ub <= 0.02, "{ua} {ub}");
}

/// The H200's table 4 shape: a request of 60 × 30 µs kernels with 70 µs of host work
/// between them (6 ms, the GPU busy less than a third of it) every 10 ms, beside a
/// best-effort training loop of 200 µs kernels. Returns the latencies and the loop's busy
/// fraction.
fn launch_bound_service_beside_training(with_training: bool) -> (Vec<Nanos>, f64) {
    // The engine that models two contexts time-slicing the H200.
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let lat = Rc::new(RefCell::new(Vec::new()));
    w.add(
        share_cfg(100, 0),
        SimTable::new(0).view_sharing(&board, 0x1),
        requests(60, 30 * US, Some(70 * US), 4 * MS, lat.clone()),
    );
    let lo = with_training.then(|| tenant(&mut w, &board, 0, 0x2, kernel_loop(200 * US)));
    w.run_until(5 * S);
    let busy = lo.map_or(0.0, |id| w.gpu.busy_fraction(id, S, 5 * S));
    let lat: Vec<Nanos> = lat.borrow()[20..].to_vec();
    (lat, busy)
}

/// Holding the loop for the service's whole request plus its grace gave it 0.13 here (with
/// the 2 ms grace of the time): a priority-0 container's `busy_until` covers its host gaps.
/// Gap filling (a held container launches, with a 125 µs queue, while the urgent one has
/// little queued and publishes a utilization that leaves room) gives it about 0.61 with p99
/// 1.19x.
#[test]
fn best_effort_fills_the_gaps_of_a_launch_bound_service() {
    // Holding the loop whenever the service has work left the GPU idle in the service's
    // host gaps: the loop got about a third of its alone throughput on the H200.
    let (alone, _) = launch_bound_service_beside_training(false);
    let (shared, busy) = launch_bound_service_beside_training(true);
    let (p50a, p99a) = (percentile(&alone, 0.5), percentile(&alone, 0.99));
    let (p50, p99) = (percentile(&shared, 0.5), percentile(&shared, 0.99));
    eprintln!("alone p50 {p50a} p99 {p99a}; beside p50 {p50} p99 {p99}; training {busy:.3}");
    assert!(p50 as f64 <= 1.25 * p50a as f64, "p50 {p50} vs {p50a}");
    assert!(p99 as f64 <= 1.25 * p99a as f64, "p99 {p99} vs {p99a}");
    assert!(busy >= 0.5, "best effort got {busy:.3}");
}

/// Table 3's shape with a real host: matmul-like 150 µs kernels, 20 µs of host per launch
/// (PyTorch), wake-ups up to 250 µs late; tenant `i` idle during `idle(i)`.
fn four_tenants_on_a_slow_host(idle: impl Fn(usize) -> Vec<(Nanos, Nanos)>) -> (World, Vec<usize>) {
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let ids = four_tenants(&mut w, &board, |i| loop_with_idle(150 * US, idle(i)));
    for &id in &ids {
        w.apps[id].launch_cost = 20 * US;
        w.apps[id].max_oversleep = 250 * US;
    }
    w.run_until(7 * S);
    (w, ids)
}

#[test]
fn four_tenants_on_a_slow_host_keep_the_gpu_busy() {
    let (w, ids) = four_tenants_on_a_slow_host(|i| vec![((i as u64 + 2) * S, (i as u64 + 3) * S)]);
    for phase in 0..5u64 {
        let (t0, t1) = ((phase + 1) * S + 250 * MS, (phase + 2) * S);
        let got: Vec<f64> = ids
            .iter()
            .map(|&id| w.gpu.busy_fraction(id, t0, t1))
            .collect();
        let device: f64 = got.iter().sum();
        eprintln!("phase {phase}: {got:.3?} device {device:.3}");
        for (i, &u) in got.iter().enumerate() {
            if phase != i as u64 + 1 {
                let share = f64::from(FOUR_SHARES[i]) / 100.0;
                assert!(u >= share - 0.015, "phase {phase}: tenant {i} got {u:.3}");
            }
        }
        // The H200 reached only 0.87-0.93 here: what it loses is not in this model.
        assert!(device >= 0.95, "phase {phase}: device busy {device:.3}");
        // Wake-ups up to 250 µs late make a window's loss vary by more than a launch.
        let idle = (phase as usize).checked_sub(1);
        assert_parts_of_delivered(&format!("phase {phase}"), &got, idle, 0.75);
    }
}

#[test]
fn a_held_container_asks_again_when_the_holders_claim_runs_out() {
    // Held by a busy service of higher priority whose claim runs out in 300 us: a
    // best-effort container waits that long, not a whole demand poll (0.5 ms), so it is
    // back on the GPU as soon as the service's request is over.
    let clock = SimClock::default();
    let now = 10 * S;
    clock.set(now);
    let gpu = SimGpu::new(GpuMode::Serial);
    let board = SimShares::default();
    board.put(record(0x1, 0, 0, now + 300 * US, now));
    let timer = SimTimer {
        gpu,
        clock: clock.clone(),
    };
    let view = SimTable::new(0).view_sharing(&board, 0x2);
    let mut l = crate::Limiter::new(share_cfg(100, 1), clock.clone(), timer, view);
    assert_eq!(l.admit(1), crate::Admission::Wait(300 * US + 1));
    // The claim ran out: the container goes.
    clock.set(now + 300 * US + 1);
    assert!(matches!(l.admit(1), crate::Admission::Go(_)));
}

#[test]
fn launch_lengths_that_wander_around_a_cycle_boundary_do_not_flip_the_turns() {
    // Four tenants whose kernels take 225-275 us: the cycle their windows need (16 launches
    // in the 10% window) is 40 ms just below 250 us and 80 ms above. Each container lays the
    // turns out from the launch lengths on the board, so lengths republished at every
    // wander flipped the layout several times a second on the H200 (60-80 changes in 20 s,
    // the device 91-99% busy with one of four idle); each flip costs the windows in flight.
    // The parts are averaged over five wanders: one wander's differ from another's by up to
    // 0.8 point for the 40% tenant (a launch measured long stretches the cycle for a while).
    let seeds = [1u64, 100, 200, 300, 400];
    let mut mean = [0.0; 4];
    for seed in seeds {
        let (mut w, board) = on_one_board(GpuMode::Preempting);
        let ids = four_tenants(&mut w, &board, |i| {
            let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (i as u64 + seed);
            Box::new(move |_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                Step::Launch(225 * US + x % (50 * US))
            })
        });
        w.run_until(2 * S);
        let before: Vec<u64> = ids
            .iter()
            .map(|&id| w.apps[id].limiter.stats().turn_changes)
            .collect();
        w.run_until(6 * S);
        let mut got = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let changes = w.apps[id].limiter.stats().turn_changes - before[i];
            assert!(
                changes <= 4,
                "seed {seed}, tenant {i}: {changes} turn changes in 4 s"
            );
            got.push(w.gpu.busy_fraction(id, 2 * S, 6 * S));
        }
        let device: f64 = got.iter().sum();
        assert!(device >= 0.95, "seed {seed}: device busy {device:.3}");
        for (m, g) in mean.iter_mut().zip(&got) {
            *m += g / seeds.len() as f64;
        }
    }
    // Each its part of what the device delivered (the edges' cost shared in proportion).
    assert_parts_of_delivered("wandering launches", &mean, None, 0.5);
}

#[test]
fn a_kernel_mix_fills_its_window_though_its_fit_is_overestimated() {
    // One of two 50% tenants launches 200 us kernels with a longer one now and then: its
    // pacer's cost (the mean) is above the outlier-free one, so the work it fits into a
    // window by that cost leaves the window partly empty (H200: a tenant fitted 423 us for
    // 203 us launches). Seeing what is really still queued when the window seems full
    // gives it back its share (0.42-0.48 of the GPU before, 0.50-0.51 after).
    for (every, long) in [(8u64, 1000 * US), (20, 400 * US), (4, 400 * US)] {
        let (mut w, board) = on_one_board(GpuMode::Preempting);
        let mut n = 0u64;
        let mix = Box::new(move |_| {
            n += 1;
            Step::Launch(if n % every == 0 { long } else { 200 * US })
        });
        let a = tenant(&mut w, &board, 50, 0x1, mix);
        let b = tenant(&mut w, &board, 50, 0x2, kernel_loop(200 * US));
        w.run_until(4 * S);
        let (ua, ub) = (
            w.gpu.busy_fraction(a, S, 4 * S),
            w.gpu.busy_fraction(b, S, 4 * S),
        );
        assert!(
            ua >= 0.485,
            "every {every}th launch {long} ns: the mix got {ua:.3}"
        );
        assert!(
            ub >= 0.485,
            "every {every}th launch {long} ns: the loop got {ub:.3}"
        );
    }
}

/// Priority between sparse requests and idle spells: the rank memory and the heartbeat.
mod idle;
