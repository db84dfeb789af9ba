//! Model tests of the limiter on the time-sliced GPU ([`crate::sim`]): each rule of the
//! model, and the workloads the benches measure on the H200 (training loops with host gaps,
//! services, kernel loops), compared with plain time slicing in the same world.

mod cap;
mod priority;
mod share;

pub(crate) use std::cell::{Cell, RefCell};
pub(crate) use std::rc::Rc;

pub(crate) use crate::Nanos;
pub(crate) use crate::sim::*;

/// Makes a workload from a seed (its launches' identities).
pub(crate) type Maker = fn(u64) -> Workload;

/// A launch-bound training loop: 60 kernels a step of 20–120 µs, 25 µs of host time before
/// each (the framework's per-op overhead: the GPU idles between kernels), `loss.item()`,
/// then 1 ms of host work. Alone it keeps the GPU about two thirds busy.
pub(crate) fn small_batch_trainer(salt: u64) -> Workload {
    training(model_step(60, &[20, 45, 120, 30, 80], salt), 25 * US, MS)
}

/// A GPU-bound training loop: 40 kernels a step of 150–900 µs, 10 µs of host time before
/// each (the host runs ahead), `loss.item()`, then 2 ms of host work.
pub(crate) fn large_batch_trainer(salt: u64) -> Workload {
    training(model_step(40, &[150, 400, 900, 250], salt), 10 * US, 2 * MS)
}

/// Steps per second of app `i` over `[t0, t1)`.
pub(crate) fn rate(w: &World, i: usize, t0: Nanos, t1: Nanos) -> f64 {
    w.apps[i].done_in(t0, t1) as f64 / ((t1 - t0) as f64 / S as f64)
}

/// Runs `tenants` together for `secs` after a 0.5 s warm-up; returns each one's GPU time
/// share and steps per second over the measured part.
pub(crate) fn run_together(
    tenants: Vec<(Tenant, Workload)>,
    secs: u64,
) -> (World, Vec<(f64, f64)>) {
    let mut w = World::new();
    let ids: Vec<usize> = tenants
        .into_iter()
        .map(|(t, work)| w.add(t, work))
        .collect();
    let (t0, t1) = (S / 2, S / 2 + secs * S);
    w.run_until(t1);
    let out = ids
        .iter()
        .map(|&i| (w.share(i, t0, t1), rate(&w, i, t0, t1)))
        .collect();
    (w, out)
}

/// The same workload alone and bare: its GPU time share and steps per second.
pub(crate) fn alone(work: Workload, secs: u64) -> (f64, f64) {
    run_together(vec![(Tenant::bare(), work)], secs).1[0]
}

#[test]
#[ignore = "a diagnostic: prints a pair's shares and counters"]
fn diag_pair() {
    let mut w = World::new();
    let a = w.add(Tenant::share(30), kernel_loop(200 * US));
    let b = w.add(Tenant::share(70), kernel_loop(201 * US));
    for k in 1..=10 {
        w.run_until(k * 200 * MS);
        let t0 = (k - 1) * 200 * MS;
        let (x, y) = (w.share(a, t0, k * 200 * MS), w.share(b, t0, k * 200 * MS));
        let (la, lb) = (&w.apps[a].limiter, &w.apps[b].limiter);
        println!(
            "{k}: {x:.2} {y:.2} | a {:?} {:?} | b {:?}",
            la.allotment(),
            la.stats(),
            lb.allotment()
        );
        println!("   board {:?}", w.board.0.borrow());
    }
}

#[test]
#[ignore = "a diagnostic: prints the pairs' shares"]
fn diag_pairs() {
    let kinds: [(&str, Maker); 3] = [
        ("small", small_batch_trainer),
        ("large", large_batch_trainer),
        ("loop", |_| kernel_loop(200 * US)),
    ];
    for (na, a) in kinds {
        for (nb, b) in kinds {
            let (_, ra) = alone(a(1), 2);
            let (_, rb) = alone(b(2), 2);
            for (mode, ta, tb) in [
                ("plain", Tenant::bare(), Tenant::bare()),
                ("cap", Tenant::cap(30), Tenant::cap(70)),
                ("share", Tenant::share(30), Tenant::share(70)),
            ] {
                let (w, got) = run_together(vec![(ta, a(1)), (tb, b(2))], 3);
                let (sa, sb) = (w.apps[0].limiter.stats(), w.apps[1].limiter.stats());
                println!(
                    "{na:>5}/{nb:<5} {mode:<5} gpu {:5.1} {:5.1}  thr {:4.2} {:4.2} sum {:4.2} | waits a {} {} {} b {} {} {}",
                    got[0].0 * 100.0,
                    got[1].0 * 100.0,
                    got[0].1 / ra,
                    got[1].1 / rb,
                    got[0].1 / ra + got[1].1 / rb,
                    sa.pace_waits,
                    sa.queue_waits,
                    sa.hold_waits,
                    sb.pace_waits,
                    sb.queue_waits,
                    sb.hold_waits
                );
            }
        }
    }
}

#[test]
#[ignore = "a diagnostic: a capped large-batch trainer's learned costs"]
fn diag_costs() {
    let (w, got) = run_together(
        vec![
            (Tenant::share(30), large_batch_trainer(1)),
            (Tenant::share(70), large_batch_trainer(2)),
        ],
        3,
    );
    println!("{got:?} {:?}", w.apps[0].limiter.stats());
    let end = S / 2 + 3 * S;
    println!(
        "true over the whole run {:.3}, charged {:.3}, launched work {:.3}",
        w.share(0, 0, end),
        w.apps[0].limiter.stats().busy_ns / end as f64,
        w.apps[0].launches as f64 * 425e3 / end as f64
    );
    let step = model_step(40, &[150, 400, 900, 250], 1);
    let mut over = 0.0;
    for (dur, id) in step.iter() {
        let c = w.apps[0].limiter.launch_cost(*id).unwrap_or(0.0);
        if (c - *dur as f64).abs() > 1_000.0 {
            println!("{id}: {dur} -> {c}");
        }
        over += c - *dur as f64;
    }
    println!("a step over by {over} ns");
}

#[test]
#[ignore = "a diagnostic: lending and return"]
fn diag_lend() {
    let mut w = World::new();
    let a = w.add(Tenant::share(30), kernel_loop(200 * US));
    let idle = Rc::new(Cell::new(false));
    let flag = idle.clone();
    let mut inner = kernel_loop(201 * US);
    let b = w.add(
        Tenant::share(70),
        Box::new(move |t| {
            if flag.get() {
                Step::Pause(MS)
            } else {
                inner(t)
            }
        }),
    );
    for k in 1..=20u64 {
        if k == 6 {
            idle.set(true);
        }
        if k == 11 {
            idle.set(false);
        }
        w.run_until(k * 100 * MS);
        let t0 = (k - 1) * 100 * MS;
        let (x, y) = (w.share(a, t0, k * 100 * MS), w.share(b, t0, k * 100 * MS));
        println!(
            "{k}: {x:.2} {y:.2} a {:?} | b {:?}",
            w.apps[a].limiter.allotment(),
            w.apps[b].limiter.allotment()
        );
    }
}
