//! Accounting of memory the driver reserves on its own schedule (stream-ordered pools,
//! graph memory): we charge what the driver reports it *holds*, per pool (or per device
//! for graph memory), not a high-water guess.
//!
//! Protocol per allocation: reserve a tentative amount in the ledger *before* asking the
//! driver (the part of the request the pool cannot serve from what it already holds), so
//! the limit still refuses up front; then measure what the pool holds and [`settle`]
//! the difference against what was charged so far. Measurements at frees, trims and sync
//! points give back what the pool released.
//!
//! If a pool grew by more than was reserved (it grows in its own chunk sizes) and the
//! ledger refuses the excess, the excess is remembered as a shortfall and charged at the
//! next settle; it is never silently dropped.
//!
//! [`settle`]: MeasuredTracker::settle

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_alloc_core::{DeviceIndex, OutOfMemory, UsageClass, UsageLedger};

/// One tracked pool (or device graph heap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Measured {
    /// Device the memory lives on.
    pub(crate) device: DeviceIndex,
    /// Bytes charged to the ledger for it.
    pub(crate) accounted: u64,
    /// Bytes it holds beyond `accounted` because the ledger refused them (0 normally).
    pub(crate) shortfall: u64,
}

/// Charges of driver-managed memory, keyed by pool handle or device.
#[derive(Debug)]
pub(crate) struct MeasuredTracker<K> {
    entries: Mutex<HashMap<K, Measured>>,
    /// Set once anything was tracked: sync points skip all work until then.
    active: AtomicBool,
}

impl<K: Copy + Eq + Hash> Default for MeasuredTracker<K> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            active: AtomicBool::new(false),
        }
    }
}

impl<K: Copy + Eq + Hash + std::fmt::Debug> MeasuredTracker<K> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, Measured>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether anything was ever tracked (one relaxed load).
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Starts tracking `key` on `device` with nothing charged (no-op if tracked).
    pub(crate) fn register(&self, key: K, device: DeviceIndex) {
        self.lock().entry(key).or_insert(Measured {
            device,
            accounted: 0,
            shortfall: 0,
        });
        self.active.store(true, Ordering::Relaxed);
    }

    /// The entry for `key`.
    pub(crate) fn get(&self, key: K) -> Option<Measured> {
        self.lock().get(&key).copied()
    }

    /// Every tracked key.
    pub(crate) fn keys(&self) -> Vec<K> {
        self.lock().keys().copied().collect()
    }

    /// Reserves `bytes` up front for an allocation about to be made; give it to
    /// [`settle`](Self::settle) afterwards (or [`cancel`](Self::cancel) it).
    pub(crate) fn reserve_tentative(
        &self,
        ledger: &dyn UsageLedger,
        device: DeviceIndex,
        bytes: u64,
    ) -> Result<u64, OutOfMemory> {
        if bytes > 0 {
            ledger.try_reserve(device, UsageClass::Data, bytes)?;
        }
        Ok(bytes)
    }

    /// Gives back a tentative reservation whose allocation failed.
    pub(crate) fn cancel(&self, ledger: &dyn UsageLedger, device: DeviceIndex, tentative: u64) {
        if tentative > 0 {
            ledger.release(device, UsageClass::Data, tentative);
        }
    }

    /// `key` now holds `measured` bytes; `tentative` bytes were reserved for it up front.
    /// Brings the ledger charge to `measured` (or as close as the limit allows).
    /// Registers `key` on `device` if it was not tracked.
    pub(crate) fn settle(
        &self,
        ledger: &dyn UsageLedger,
        key: K,
        device: DeviceIndex,
        measured: u64,
        tentative: u64,
    ) -> Measured {
        let mut map = self.lock();
        let e = map.entry(key).or_insert(Measured {
            device,
            accounted: 0,
            shortfall: 0,
        });
        self.active.store(true, Ordering::Relaxed);
        let dev = e.device;
        if measured >= e.accounted {
            let grow = measured - e.accounted;
            let used = grow.min(tentative);
            if tentative > used {
                ledger.release(dev, UsageClass::Data, tentative - used);
            }
            e.accounted += used;
            let extra = grow - used;
            if extra > 0 && ledger.try_reserve(dev, UsageClass::Data, extra).is_ok() {
                e.accounted += extra;
            }
        } else {
            ledger.release(dev, UsageClass::Data, e.accounted - measured + tentative);
            e.accounted = measured;
        }
        e.shortfall = measured - e.accounted;
        *e
    }

    /// Stops tracking `key` (pool destroyed) and releases its charge.
    pub(crate) fn remove(&self, ledger: &dyn UsageLedger, key: K) -> Option<Measured> {
        let e = self.lock().remove(&key)?;
        if e.accounted > 0 {
            ledger.release(e.device, UsageClass::Data, e.accounted);
        }
        Some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{D, M, ledger};

    #[test]
    fn charge_follows_what_the_pool_holds() {
        let l = ledger(100 * M);
        let t: MeasuredTracker<u64> = MeasuredTracker::default();
        assert!(!t.is_active());
        // 10 MiB requested, the pool grew by 32 MiB (its chunk): charge 32.
        let tent = t.reserve_tentative(&l, D, 10 * M).unwrap();
        assert_eq!(l.usage(D).used, 10 * M);
        let m = t.settle(&l, 7, D, 32 * M, tent);
        assert_eq!((m.accounted, m.shortfall), (32 * M, 0));
        assert_eq!(l.usage(D).used, 32 * M);
        assert!(t.is_active());
        // Served from the pool's free space: nothing more.
        let tent = t.reserve_tentative(&l, D, 0).unwrap();
        assert_eq!(t.settle(&l, 7, D, 32 * M, tent).accounted, 32 * M);
        // A tentative reservation the pool did not need is returned.
        let tent = t.reserve_tentative(&l, D, 8 * M).unwrap();
        t.settle(&l, 7, D, 32 * M, tent);
        assert_eq!(l.usage(D).used, 32 * M);
        // The pool released memory at a sync point.
        t.settle(&l, 7, D, 4 * M, 0);
        assert_eq!(l.usage(D).used, 4 * M);
        // Destroy releases the rest.
        assert_eq!(t.remove(&l, 7).unwrap().accounted, 4 * M);
        assert_eq!(l.usage(D).used, 0);
        assert_eq!(t.remove(&l, 7), None);
    }

    #[test]
    fn limit_refuses_up_front_and_excess_becomes_shortfall() {
        let l = ledger(40 * M);
        let t: MeasuredTracker<u64> = MeasuredTracker::default();
        assert!(t.reserve_tentative(&l, D, 41 * M).is_err());
        assert_eq!(l.usage(D).used, 0);
        let tent = t.reserve_tentative(&l, D, 30 * M).unwrap();
        // Pool grew 64 MiB: 40 fits, 24 is a shortfall (charged later if room appears).
        let m = t.settle(&l, 1, D, 64 * M, tent);
        assert_eq!((m.accounted, m.shortfall), (30 * M, 34 * M));
        // Ledger had room for 10 more but the excess (34) did not fit as a whole.
        assert_eq!(l.usage(D).used, 30 * M);
        // Pool trimmed to 36 MiB: the shortfall (6) now fits.
        let m = t.settle(&l, 1, D, 36 * M, 0);
        assert_eq!((m.accounted, m.shortfall), (36 * M, 0));
        assert_eq!(l.usage(D).used, 36 * M);
        t.cancel(&l, D, 0);
        t.remove(&l, 1);
        assert_eq!(l.usage(D).used, 0);
    }

    #[test]
    fn shrink_also_returns_an_unused_tentative() {
        let l = ledger(100 * M);
        let t: MeasuredTracker<u64> = MeasuredTracker::default();
        t.settle(
            &l,
            3,
            D,
            20 * M,
            t.reserve_tentative(&l, D, 20 * M).unwrap(),
        );
        // An allocation reserved 4 MiB but meanwhile the pool released down to 8 MiB.
        let tent = t.reserve_tentative(&l, D, 4 * M).unwrap();
        t.settle(&l, 3, D, 8 * M, tent);
        assert_eq!(l.usage(D).used, 8 * M);
        assert_eq!(t.get(3).unwrap().accounted, 8 * M);
    }
}
