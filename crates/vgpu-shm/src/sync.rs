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

/// Waiting for a lock held by someone else: spin briefly, then yield the CPU; says when it is
/// time to ask whether the holder is still alive (a system call, so not on every turn).
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    turns: u32,
}

impl Backoff {
    /// Turns of pure spinning before yielding.
    #[cfg(not(loom))]
    const SPIN_TURNS: u32 = 32;

    pub(crate) fn new() -> Self {
        Self { turns: 0 }
    }

    /// Wait a little.
    pub(crate) fn snooze(&mut self) {
        self.turns = self.turns.wrapping_add(1);
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        {
            if self.turns < Self::SPIN_TURNS {
                std::hint::spin_loop();
            } else if self.turns < 4096 {
                std::thread::yield_now();
            } else {
                // A live holder that long is descheduled or stopped: stop burning a core.
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Whether to check the holder's liveness now. Under loom: every turn (a dead holder must
    /// be noticed in every explored schedule). Otherwise after the spinning phase, then every
    /// 128 turns (about every 100 µs to 1 ms), well under the 100 ms recovery goal.
    pub(crate) fn probe_due(&self) -> bool {
        #[cfg(loom)]
        {
            true
        }
        #[cfg(not(loom))]
        {
            self.turns == Self::SPIN_TURNS
                || (self.turns > Self::SPIN_TURNS && self.turns % 128 == 0)
                || self.turns >= 4096
        }
    }
}
