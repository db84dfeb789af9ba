//! The hook's background threads (the share-mode heartbeat): the controls every one of them
//! needs, in one place.
//!
//! **Invariant.** A worker's thread starts at most once per process ([`Worker::claim`] then
//! [`Worker::spawn`]); once [`Worker::stop`] returns, the thread starts no step (its
//! [`Worker::step`] answers [`Stopped`]), and a step in progress then has ended, unless it
//! outlasted the bounded wait (an exit never hangs on it). In a forked child, to which the
//! thread was not copied, [`Worker::reset_in_child`] forgets it, so the child's first need
//! starts its own. Atomics only, so a fork at any instant leaves nothing locked; a panic in
//! a step is caught (that step's work is lost, not the thread).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::sync::{Flag, Ordering};

/// A worker thread's stack (and the hook's other threads'): glibc's default for any thread (8 MiB of address space; only the
/// pages touched cost memory). glibc carves the program's static TLS out of every thread's
/// stack, so a smaller one may leave the hook's thread almost nothing in a program with
/// large `__thread` arrays: 256 KiB overflowed in a test program with 2 MiB of them (the
/// room test in tests/swap.rs), which would kill the host program.
pub(crate) const WORKER_STACK: usize = 8 << 20;

/// The thread was stopped (at exit): it must return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stopped;

/// One background thread's controls (a `static` part of the process state).
pub(crate) struct Worker<F = AtomicBool> {
    /// Whether the thread runs (or is being started).
    running: F,
    /// Set at exit: no step after it.
    stop: F,
    /// Set while the thread is in a step.
    in_step: F,
}

impl Worker {
    pub(crate) const fn new() -> Self {
        Self {
            running: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            in_step: AtomicBool::new(false),
        }
    }

    /// Starts `body` on a thread named `name` (after [`Worker::claim`] said so), with a stack
    /// of [`WORKER_STACK`].
    pub(crate) fn spawn(
        &'static self,
        name: &str,
        body: impl FnOnce(&'static Worker) + Send + 'static,
    ) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name(name.into())
            .stack_size(WORKER_STACK)
            .spawn(move || body(self))
            .map(drop)
    }

    /// At exit: no step after this returns, and the one in progress has ended, or `wait`
    /// has passed.
    pub(crate) fn stop(&self, wait: Duration) {
        self.request_stop();
        let mut waited = Duration::ZERO;
        while self.step_in_progress() && waited < wait {
            std::thread::sleep(Duration::from_millis(1));
            waited += Duration::from_millis(1);
        }
    }
}

impl<F: Flag> Worker<F> {
    /// Whether the caller is the one to start the thread: true once per process (until a
    /// fork resets it), false while it runs or is being started. A spawn that fails is not
    /// retried: a process that cannot start threads won't later.
    pub(crate) fn claim(&self) -> bool {
        !self.running.load(Ordering::Relaxed) && !self.running.swap(true, Ordering::AcqRel)
    }

    /// Whether the worker was stopped.
    #[cfg(test)]
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Runs one step `f` on the thread, unless the worker was stopped. `Ok(None)` if `f`
    /// panicked.
    pub(crate) fn step<R>(&self, f: impl FnOnce() -> R) -> Result<Option<R>, Stopped> {
        // Either this sees `stop` and does not step, or the stopper sees this step in
        // progress (a store-buffering handshake). Every access to the two flags here and in
        // the stopper is a read-modify-write: an RMW reads the latest value in its flag's
        // order, which makes the handshake hold with acquire/release alone (and lets loom,
        // which does not model SeqCst's total order, check it).
        self.in_step.swap(true, Ordering::AcqRel);
        if self.stop.fetch_or(false, Ordering::AcqRel) {
            self.in_step.store(false, Ordering::Release);
            return Err(Stopped);
        }
        // A panic would end the thread with `in_step` set, and exit would wait its full
        // bound for nothing.
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok();
        // Release: what the step did happens before the stopper's teardown.
        self.in_step.store(false, Ordering::Release);
        Ok(out)
    }

    /// The first half of [`Worker::stop`]: no step starts after this.
    fn request_stop(&self) {
        self.stop.swap(true, Ordering::AcqRel);
    }

    /// The second half: whether a step that started before is still running.
    fn step_in_progress(&self) -> bool {
        self.in_step.fetch_or(false, Ordering::AcqRel)
    }

    /// In the child after `fork`: the thread was not copied, nor is it in a step (a fork
    /// during one copied the flag set).
    pub(crate) fn reset_in_child(&self) {
        self.running.store(false, Ordering::Relaxed);
        self.in_step.store(false, Ordering::Relaxed);
    }

    #[cfg(test)]
    pub(crate) fn in_step(&self) -> bool {
        self.step_in_progress()
    }

    #[cfg(test)]
    pub(crate) fn enter_step_for_test(&self) {
        self.in_step.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn leaked() -> &'static Worker {
        Box::leak(Box::new(Worker::new()))
    }

    #[test]
    fn one_claim_per_process_until_a_fork_resets_it() {
        let w = leaked();
        assert!(w.claim());
        assert!(!w.claim(), "running: no second thread");
        w.reset_in_child();
        assert!(w.claim(), "the child starts its own");
    }

    #[test]
    fn no_step_after_stop_and_a_panicking_step_is_caught() {
        let w = leaked();
        assert_eq!(w.step(|| 7), Ok(Some(7)));
        assert_eq!(w.step(|| -> u8 { panic!("a step that panics") }), Ok(None));
        assert!(!w.in_step(), "a panicking step leaves no step in progress");
        w.stop(Duration::from_millis(100));
        assert!(w.stopped());
        let ran = AtomicUsize::new(0);
        assert_eq!(w.step(|| ran.fetch_add(1, Ordering::SeqCst)), Err(Stopped));
        assert_eq!(ran.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_child_forked_during_a_step_does_not_wait_for_it_at_exit() {
        let w = leaked();
        // The parent's thread was in a step when the process forked.
        w.enter_step_for_test();
        w.reset_in_child();
        assert!(!w.in_step(), "exit would wait for a step no thread makes");
    }

    #[test]
    fn a_spawned_body_steps_until_stopped() {
        static STEPS: AtomicUsize = AtomicUsize::new(0);
        let w = leaked();
        assert!(w.claim());
        w.spawn("vgpu-test-worker", |w| {
            while w.step(|| STEPS.fetch_add(1, Ordering::SeqCst)).is_ok() {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .unwrap();
        let t0 = std::time::Instant::now();
        while STEPS.load(Ordering::SeqCst) < 3 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no steps");
            std::thread::sleep(Duration::from_millis(1));
        }
        w.stop(Duration::from_millis(100));
        let after = STEPS.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(STEPS.load(Ordering::SeqCst), after, "no step after stop");
    }
}

#[cfg(all(test, loom))]
#[allow(unsafe_code)] // the model's cell: loom checks its accesses are ordered
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool as LoomBool;

    fn worker() -> Worker<LoomBool> {
        Worker {
            running: LoomBool::new(true),
            stop: LoomBool::new(false),
            in_step: LoomBool::new(false),
        }
    }

    #[test]
    fn loom_no_step_runs_once_stop_saw_none_in_progress() {
        loom::model(|| {
            let w = Arc::new(worker());
            // What steps use and the exiting process tears down once the stopper saw no
            // step in progress (NVML, the board entries): loom reports any access to it
            // that the protocol does not order before the teardown.
            let used = Arc::new(UnsafeCell::new(0u32));
            let (w2, u2) = (w.clone(), used.clone());
            let thread = loom::thread::spawn(move || {
                for _ in 0..2 {
                    // SAFETY: the protocol orders this before the teardown (what loom checks).
                    if w2.step(|| u2.with_mut(|p| unsafe { *p += 1 })).is_err() {
                        return;
                    }
                }
            });
            w.request_stop();
            if !w.step_in_progress() {
                // SAFETY: no step is in progress nor starts (what loom checks).
                used.with_mut(|p| unsafe { *p = 0 });
            }
            thread.join().unwrap();
            assert_eq!(w.step(|| ()), Err(Stopped));
        });
    }
}
