//! Share mode's models of a container between its launches: a sparse service's rank
//! (`ShareRules::rank_memory`) and the idle heartbeat that keeps a live container on the
//! board.

use super::*;

/// Requests of 20 × 100 µs every `think`, beside a best-effort loop of 200 µs kernels or
/// alone, on a first-come engine (a request waits for whatever the loop queued before it);
/// returns the latencies after the first request.
fn sparse_service(think: Nanos, with_training: bool) -> Vec<Nanos> {
    let (mut w, board) = on_one_board(GpuMode::Serial);
    let lat = Rc::new(RefCell::new(Vec::new()));
    w.add(
        share_cfg(100, 0),
        SimTable::new(0).view_sharing(&board, 0x1),
        requests(20, 100 * US, None, think, lat.clone()),
    );
    if with_training {
        w.add(
            share_cfg(100, 1),
            SimTable::new(0).view_sharing(&board, 0x2),
            kernel_loop(200 * US),
        );
    }
    w.run_until(12 * S);
    let lat = lat.borrow();
    lat[1..].to_vec()
}

#[test]
fn a_sparse_service_keeps_its_rank_between_requests() {
    // A request every 700 ms: longer than a record counts as live (300 ms), so the service
    // is off the board when each request arrives. The best-effort loop must still keep its
    // queue short (the outranked queue, 0.5 ms, plus a kernel), not as deep as its pacer
    // allows when alone (each request waited 9.0-9.6 ms more than alone before
    // `ShareRules::rank_memory`).
    let alone = sparse_service(700 * MS, false);
    let shared = sparse_service(700 * MS, true);
    assert!(shared.len() >= 10, "{} requests", shared.len());
    let (p50a, worst) = (percentile(&alone, 0.5), *shared.iter().max().unwrap());
    eprintln!("alone p50 {p50a}; beside training {shared:?}");
    assert!(
        worst <= p50a + 900 * US,
        "a request waited {} us more than alone ({p50a} ns)",
        (worst - p50a) / 1_000
    );
}

#[test]
fn a_container_raised_above_the_one_it_remembers_forgets_it() {
    // A service (priority 0) runs for a second and leaves; the best-effort loop beside it
    // keeps its queue short from memory after the service's record expires, until it is
    // itself raised to priority 0 (`vgpu set-limit --priority 0`).
    let (mut w, board) = on_one_board(GpuMode::Serial);
    w.add(
        share_cfg(100, 0),
        SimTable::new(0).view_sharing(&board, 0x1),
        loop_with_idle(100 * US, vec![(S, 100 * S)]),
    );
    let tt = SimTable::new(0);
    let t = w.add(
        share_cfg(100, 1),
        tt.view_sharing(&board, 0x2),
        kernel_loop(200 * US),
    );
    let queue_waits = |w: &World| w.apps[t].limiter.stats().queue_waits;
    w.run_until(1500 * MS);
    let at_1500 = queue_waits(&w);
    w.run_until(2 * S);
    let at_2000 = queue_waits(&w);
    assert!(
        at_2000 > at_1500,
        "the service left 500 ms ago: still outranked from memory"
    );
    tt.0.borrow_mut().priority = Some(0);
    w.run_until(2100 * MS);
    let raised = queue_waits(&w);
    w.run_until(4 * S);
    assert_eq!(
        queue_waits(&w),
        raised,
        "raised to the service's priority, nothing outranks it"
    );
}

/// Runs `w` until `until`, calling every limiter's idle heartbeat every 50 ms in between,
/// as the hook's heartbeat thread does.
fn run_with_heartbeats(w: &mut World, until: Nanos) {
    let mut t = w.clock.now();
    while t < until {
        t = (t + 50 * MS).min(until);
        w.run_until(t);
        for a in &mut w.apps {
            a.limiter.idle_heartbeat();
        }
    }
}

#[test]
fn an_idle_container_stays_on_the_board_idle_and_keeps_its_rank() {
    // A service (priority 0) launches for 0.3 s, stays alive without launching until 3 s,
    // then resumes; a best-effort loop (priority 1) runs beside it. The rank memory is 1 s
    // here, so only a live record can keep the loop outranked at 3 s. With the heartbeat the
    // service's record stays fresh and says it is idle (demand run out, part 0); without it,
    // the record ages out and the loop is no longer outranked.
    let rules = crate::ShareRules {
        rank_memory: S,
        ..crate::ShareRules::default()
    };
    let cfg = |priority| LimiterConfig {
        share_rules: rules,
        ..share_cfg(100, priority)
    };
    for beat in [false, true] {
        let (mut w, board) = on_one_board(GpuMode::Preempting);
        w.add(
            cfg(0),
            SimTable::new(0).view_sharing(&board, 0xa),
            loop_with_idle(100 * US, vec![(300 * MS, 3 * S)]),
        );
        let low = w.add(
            cfg(1),
            SimTable::new(0).view_sharing(&board, 0xb),
            kernel_loop(200 * US),
        );
        let record =
            |board: &SimShares| board.0.borrow().iter().find(|e| e.0.key == 0xa).unwrap().0;
        if beat {
            run_with_heartbeats(&mut w, 3 * S - MS);
        } else {
            w.run_until(3 * S - MS);
        }
        let now = w.clock.now();
        let (r, report) = (record(&board), board.report(0xa).unwrap());
        let outranked = w.apps[low].limiter.allotment().unwrap().outranked;
        eprintln!("heartbeat {beat}: record {r:?}, report {report:?}, loop outranked {outranked}");
        if !beat {
            assert!(now - r.heartbeat > 2 * S, "no heartbeat: the record aged");
            assert!(!outranked, "the rank memory (1 s) ran out");
            continue;
        }
        assert!(now - r.heartbeat <= 150 * MS, "fresh: {r:?} at {now}");
        assert!(r.busy_until < 400 * MS, "idle since 0.3 s: {r:?}");
        assert_eq!(report.allot_pct, 0, "idle: no part");
        assert!(report.util_pct <= 1, "its utilization decayed: {report:?}");
        assert!(
            outranked,
            "a live service of higher priority outranks the loop"
        );
        // It resumes at 3 s: its first launch announces its demand and part at once.
        w.run_until(3 * S + MS);
        let (r, report) = (record(&board), board.report(0xa).unwrap());
        assert!(r.heartbeat >= 3 * S && r.busy_until > 3 * S + MS, "{r:?}");
        assert!(report.allot_pct > 0, "{report:?}");
    }
}

#[test]
fn a_heartbeat_does_nothing_while_launches_come_or_in_cap_mode() {
    // A busy container publishes from its launches: the heartbeat writes nothing more. A
    // cap-mode container never heartbeats (an idle capped one leaves the turns).
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let busy = w.add(
        share_cfg(100, 1),
        SimTable::new(30).view_sharing(&board, 0xa),
        kernel_loop(100 * US),
    );
    let capped = w.add(
        LimiterConfig::default(),
        SimTable::new(30).view(),
        loop_with_idle(100 * US, vec![(100 * MS, 100 * S)]),
    );
    w.run_until(S);
    let before = board.0.borrow()[0].0;
    for _ in 0..5 {
        w.apps[busy].limiter.idle_heartbeat();
        w.apps[capped].limiter.idle_heartbeat();
    }
    assert_eq!(
        board.0.borrow()[0].0,
        before,
        "no write beside the launches'"
    );
    assert_eq!(board.0.borrow().len(), 1);
}

#[test]
fn an_idle_process_does_not_mark_its_busy_container_idle() {
    // Two processes of one container (one key, one record): one launches, the other has
    // launched once and idles. The idle one's beats must not overwrite the busy one's
    // demand and part, while the container still stays fresh once both idle.
    let (mut w, board) = on_one_board(GpuMode::Preempting);
    let table = SimTable::new(30);
    w.add(
        share_cfg(100, 1),
        table.view_sharing(&board, 0xa),
        loop_with_idle(100 * US, vec![(S, 100 * S)]),
    );
    w.add(
        share_cfg(100, 1),
        table.view_sharing(&board, 0xa),
        loop_with_idle(100 * US, vec![(20 * MS, 100 * S)]),
    );
    let record = |board: &SimShares| board.0.borrow()[0].0;
    let mut t = 0;
    while t < 3 * S {
        t += 50 * MS;
        w.run_until(t);
        for a in &mut w.apps {
            a.limiter.idle_heartbeat();
            let r = record(&board);
            if t < S {
                assert!(
                    r.busy_until > t,
                    "at {t}: the busy process's demand was kept: {r:?}"
                );
            } else {
                assert!(
                    t - r.heartbeat <= 150 * MS,
                    "at {t}: both idle, still fresh: {r:?}"
                );
            }
        }
    }
    let r = record(&board);
    assert!(r.busy_until < S + 50 * MS, "idle since 1 s: {r:?}");
    assert_eq!(board.0.borrow().len(), 1);
}
