//! Model tests of the limiter on the time-sliced GPU ([`crate::sim`]): each rule of the
//! model, and the workloads the benches measure on the H200 (training loops with host gaps,
//! services, kernel loops), compared with plain time slicing in the same world.

mod board;
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

/// A launch-bound loop of tiny kernels (a small-batch convnet's): 300 kernels a step of
/// 4–20 µs, 15 µs of host time before each, `loss.item()`, then 1 ms of host work. Alone it
/// keeps the GPU about 40% busy, and each kernel is as short as a marker's drain is long.
pub(crate) fn tiny_kernel_trainer(salt: u64) -> Workload {
    training(model_step(300, &[4, 6, 8, 12, 20], salt), 15 * US, MS)
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
