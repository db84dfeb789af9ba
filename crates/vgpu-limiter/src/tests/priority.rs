//! Priority: a more urgent container's work waits at most the running kernel plus the short
//! queue behind a less urgent one's, and the less urgent one keeps what is left.

use super::*;

/// A batch-1 service: a request every `every` of 120 kernels of 10–40 µs with 15 µs of
/// host time before each.
fn svc(every: Nanos, lat: Rc<RefCell<Vec<Nanos>>>) -> Workload {
    service(
        model_step(120, &[10, 25, 40, 15], 9),
        15 * US,
        every,
        S / 4,
        lat,
    )
}

fn p50_p99(v: &[Nanos]) -> (f64, f64) {
    (
        quantile(v, 0.5) as f64 / 1e6,
        quantile(v, 0.99) as f64 / 1e6,
    )
}

/// The service's latencies (requests after the first second: the warm-up, in which a lone
/// best-effort loop may have queued deep before the service appeared, is left out, as the
/// benches do) with `hp` beside a kernel loop of `be_kernel` under `be` (or alone).
fn service_beside(
    hp: Tenant,
    be: Option<Tenant>,
    be_kernel: Nanos,
) -> (Vec<Nanos>, Vec<(f64, f64)>) {
    let lat = Rc::new(RefCell::new(Vec::new()));
    let mut tenants = vec![(hp, svc(10 * MS, lat.clone()))];
    if let Some(be) = be {
        tenants.push((be, kernel_loop(be_kernel)));
    }
    let (w, got) = run_together(tenants, 3);
    let v = lat
        .borrow()
        .iter()
        .zip(&w.apps[0].done)
        .filter(|(_, t)| **t > S)
        .map(|(l, _)| *l)
        .collect();
    (v, got)
}

#[test]
fn an_urgent_service_is_never_slower_than_under_time_slicing_and_waits_at_most_one_kernel() {
    let hp = Tenant::share(0).priority(0);
    let be = Tenant::share(0).priority(1);
    let (a50, a99) = p50_p99(&service_beside(hp, None, 0).0);
    for be_kernel in [100 * US, 300 * US, 2 * MS] {
        let (plain, _) = service_beside(Tenant::bare(), Some(Tenant::bare()), be_kernel);
        let (prio, got) = service_beside(hp, Some(be), be_kernel);
        let (p50, p99) = p50_p99(&plain);
        let (q50, q99) = p50_p99(&prio);
        assert!(
            q50 <= p50 && q99 <= p99,
            "{be_kernel}: {q50:.2}/{q99:.2} vs plain {p50:.2}/{p99:.2}"
        );
        // Beside kernels shorter than the service's own time slice, the bound of the model:
        // the kernel running when a request comes, plus the short queue. (Beside longer
        // ones the GPU's time slicing also runs the rest of a preempted kernel inside the
        // request: docs/sm-limit.md, "What needs preemption".)
        if be_kernel <= 300 * US {
            // Plus the GPU's own switching (0.15 ms at slice expiry, 20 µs when a context
            // yields: dead time, no one's work).
            let bound = a99 + be_kernel as f64 / 1e6 + 0.5 + 0.2;
            assert!(
                q99 <= bound,
                "{be_kernel}: p99 {q99:.2} ms, alone {a50:.2}/{a99:.2}"
            );
        }
        // The best-effort loop keeps at least half of its alone throughput (the service uses
        // about a third of the GPU).
        assert!(got[1].0 >= 0.5, "{be_kernel}: {got:?}");
    }
}

#[test]
fn a_guarantee_is_never_taken_by_priority() {
    let (_, got) = run_together(
        vec![
            (Tenant::share(0).priority(0), kernel_loop(100 * US)),
            (Tenant::share(10).priority(1), kernel_loop(100 * US)),
        ],
        3,
    );
    assert!(got[1].0 >= 0.09, "{got:?}");
    // The rest, but for the context switches' dead time.
    assert!(got[0].0 >= 0.80, "{got:?}");
}

#[test]
fn the_top_priority_alone_measures_nothing() {
    let (w, _) = run_together(
        vec![(Tenant::share(0).priority(0), kernel_loop(100 * US))],
        1,
    );
    let s = w.apps[0].limiter.stats();
    assert_eq!(s.markers, 0, "{s:?}");
    assert!(s.launches > 1_000);
}
