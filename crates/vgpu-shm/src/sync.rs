//! The `cfg(loom)` switch: atomics and waiting primitives for the protocol.
//!
//! The mapped file always uses `std` atomics (loom's cannot live in shared memory); the
//! protocol is generic over [`Atomic64`], so loom runs it on loom atomics in a heap store.

pub(crate) use std::sync::atomic::Ordering;

#[cfg(all(test, loom))]
pub(crate) use loom::sync::atomic::AtomicU64;
#[cfg(all(test, not(loom)))]
pub(crate) use std::sync::atomic::AtomicU64;

/// The atomic operations the protocol needs, for std and loom atomics alike.
pub(crate) trait Atomic64 {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
    fn compare_exchange(
        &self,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64>;
}

impl Atomic64 for std::sync::atomic::AtomicU64 {
    #[inline(always)]
    fn load(&self, order: Ordering) -> u64 {
        self.load(order)
    }
    #[inline(always)]
    fn store(&self, value: u64, order: Ordering) {
        self.store(value, order)
    }
    #[inline(always)]
    fn compare_exchange(&self, c: u64, n: u64, s: Ordering, f: Ordering) -> Result<u64, u64> {
        self.compare_exchange(c, n, s, f)
    }
}

#[cfg(loom)]
impl Atomic64 for loom::sync::atomic::AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        self.load(order)
    }
    fn store(&self, value: u64, order: Ordering) {
        self.store(value, order)
    }
    fn compare_exchange(&self, c: u64, n: u64, s: Ordering, f: Ordering) -> Result<u64, u64> {
        self.compare_exchange(c, n, s, f)
    }
}

/// Waiting for a lock held by someone else: spin briefly, then yield the CPU, then sleep;
/// says when it is time to ask whether the holder is still alive (a system call, so not on
/// every turn, but by the clock: a yield can cost a whole time slice on a busy machine).
///
/// Not `crossbeam_utils::Backoff`: its step count neither sleeps nor tells when spinning
/// ends, so the clock state here would stay anyway; and under our `cfg(loom)` it would spin
/// on std's hints, which loom's scheduler never sees (crossbeam switches only under its own
/// `cfg(crossbeam_loom)`), so the loom variant below would stay too.
#[derive(Debug)]
pub(crate) struct Backoff {
    #[cfg(not(loom))]
    turns: u32,
    #[cfg(not(loom))]
    since: Option<std::time::Instant>,
    #[cfg(not(loom))]
    last_probe: Option<std::time::Instant>,
}

#[cfg(not(loom))]
impl Backoff {
    /// Turns of pure spinning before yielding (a holder normally leaves within nanoseconds).
    const SPIN_TURNS: u32 = 32;
    /// Interval of liveness probes while waiting.
    const PROBE_EVERY: std::time::Duration = std::time::Duration::from_micros(500);
    /// After this much waiting, sleep instead of yielding (a stopped or descheduled holder).
    const SLEEP_AFTER: std::time::Duration = std::time::Duration::from_millis(5);

    pub(crate) fn new() -> Self {
        Self {
            turns: 0,
            since: None,
            last_probe: None,
        }
    }

    /// Wait a little.
    pub(crate) fn snooze(&mut self) {
        self.turns = self.turns.saturating_add(1);
        if self.turns < Self::SPIN_TURNS {
            std::hint::spin_loop();
            return;
        }
        let since = *self.since.get_or_insert_with(std::time::Instant::now);
        if since.elapsed() < Self::SLEEP_AFTER {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Whether to check the holder's liveness now: when spinning ends, then every 500 µs of
    /// waiting, so a dead holder is noticed within about a millisecond (goal: < 100 ms).
    pub(crate) fn probe_due(&mut self) -> bool {
        if self.turns < Self::SPIN_TURNS {
            return false;
        }
        let now = std::time::Instant::now();
        match self.last_probe {
            Some(t) if now.duration_since(t) < Self::PROBE_EVERY => false,
            _ => {
                self.last_probe = Some(now);
                true
            }
        }
    }
}

#[cfg(loom)]
impl Backoff {
    pub(crate) fn new() -> Self {
        Self {}
    }

    /// Let another thread run.
    pub(crate) fn snooze(&mut self) {
        loom::thread::yield_now();
    }

    /// Every turn: a dead holder must be noticed in every explored schedule.
    pub(crate) fn probe_due(&mut self) -> bool {
        true
    }
}
