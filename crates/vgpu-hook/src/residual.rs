//! Driver-internal memory the hook cannot see call by call (module code loaded lazily on a
//! function's first use, the driver's own heaps), charged as *module* memory by
//! reconciling with NVML's per-process used memory.
//!
//! The residual of a device is `NVML's used memory of this process − what vgpu already
//! charges for it there` (its context, data, pools, graph memory, VMM handles), clamped at
//! 0 and rounded down to whole device pages ([`DEVICE_PAGE`], so the few hundred bytes by
//! which a computed size differs from the driver's never churn the shared table); the module
//! charge is brought to it, up or down. What NVML's per-process figure includes and vgpu
//! charges elsewhere is therefore counted once: the residual is only what is left.
//!
//! When it runs (see `hooks/residual_charge.rs` and its callers): after every module/library
//! load and unload and context creation; on `cuMemGetInfo`, NVML's memory views and
//! driver-reaching allocations at most once per [`Residual::due`] interval; before refusing
//! an allocation while a residual is charged. Never on kernel launches or the sub-allocated alloc/free path.
//!
//! Pure bookkeeping here (no driver calls); unit tested with an in-memory ledger.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vgpu_alloc_core::{DeviceIndex, MAX_DEVICES, OutOfMemory, UsageClass, UsageLedger};

use crate::accounting::DEVICE_PAGE;

/// What to do when a grown residual does not fit under the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverLimit {
    /// The memory is already taken: charge it anyway (usage shows above the limit).
    Charge,
    /// Charge nothing more and report the refusal: the caller undoes what took the memory
    /// (an explicit module load) and settles again.
    Refuse,
}

/// The outcome of one settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settled {
    /// The residual now charged on the device.
    pub(crate) charged: u64,
    /// The residual was charged although it put usage over the limit ([`OverLimit::Charge`]).
    pub(crate) over_limit: Option<OutOfMemory>,
}

/// The residual charge of this process, per device.
#[derive(Debug)]
pub(crate) struct Residual {
    /// Bytes charged as [`UsageClass::Module`] per device. The lock serializes settles, so
    /// two threads never apply the same difference twice.
    charged: Mutex<[u64; MAX_DEVICES]>,
    /// Nonzero charge exists somewhere (lets the refusal path skip all work otherwise).
    any_charged: AtomicBool,
    /// Minimum nanoseconds between rate-limited settles; `None` = reconciliation off.
    interval_ns: Option<u64>,
    /// When the last rate-limited settle was claimed (`CLOCK_MONOTONIC` ns,
    /// [`vgpu_shm::monotonic_ns`]; 0 = never).
    last_ns: AtomicU64,
    /// This process's contexts (handle → device) that vgpu measured: NVML lists a process
    /// on a device only while it has a context there.
    contexts: Mutex<HashMap<usize, DeviceIndex>>,
    /// One-time log flags.
    said_not_listed: AtomicBool,
    said_over_limit: AtomicBool,
}

impl Residual {
    /// A tracker that may settle every `interval_ms` on rate-limited paths (`None`: never
    /// settles at all).
    pub(crate) fn new(interval_ms: Option<u64>) -> Self {
        Self {
            charged: Mutex::new([0; MAX_DEVICES]),
            any_charged: AtomicBool::new(false),
            interval_ns: interval_ms.map(|ms| ms.saturating_mul(1_000_000)),
            last_ns: AtomicU64::new(0),
            contexts: Mutex::new(HashMap::new()),
            said_not_listed: AtomicBool::new(false),
            said_over_limit: AtomicBool::new(false),
        }
    }

    /// Whether reconciliation is on (`VGPU_RECONCILE_MS` is not `off`).
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.interval_ns.is_some()
    }

    /// Whether a rate-limited settle may run now; claims the slot if so (one clock read and
    /// one compare-and-swap; racing threads: one wins).
    pub(crate) fn due(&self) -> bool {
        let Some(interval) = self.interval_ns else {
            return false;
        };
        let now = vgpu_shm::monotonic_ns();
        let last = self.last_ns.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= interval)
            && self
                .last_ns
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Marks a settle that ran outside the rate limit (loads, context creation), so the
    /// rate-limited paths do not repeat it at once.
    pub(crate) fn ran_now(&self) {
        if self.interval_ns.is_some() {
            let now = vgpu_shm::monotonic_ns();
            self.last_ns.store(now, Ordering::Relaxed);
        }
    }

    /// A context of this process now exists on `device`.
    pub(crate) fn context_created(&self, ctx: usize, device: DeviceIndex) {
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ctx, device);
    }

    /// Context `ctx` is gone.
    pub(crate) fn context_gone(&self, ctx: usize) {
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ctx);
    }

    /// Whether this process has a context on `device`.
    pub(crate) fn has_context(&self, device: DeviceIndex) -> bool {
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .any(|&d| d == device)
    }

    /// Whether `device` needs reconciling: a context there, or a residual still charged.
    pub(crate) fn tracks(&self, device: DeviceIndex) -> bool {
        self.has_context(device) || self.charged(device) > 0
    }

    /// The residual charged on `device`.
    pub(crate) fn charged(&self, device: DeviceIndex) -> u64 {
        self.lock().get(device.as_usize()).copied().unwrap_or(0)
    }

    /// Whether any device has a residual charged (one relaxed load).
    #[inline]
    pub(crate) fn any_charged(&self) -> bool {
        self.any_charged.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [u64; MAX_DEVICES]> {
        self.charged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings the residual charge of `device` to `process_used − (held − residual)`.
    ///
    /// `process_used`: NVML's used memory of this process on the device, read *before*
    /// `held`. `held`: what the ledger holds for this process on the device (every class,
    /// the residual included), read under our lock. Reading NVML first errs low: memory
    /// allocated in between is in `held` but not in `process_used`, and the next settle
    /// catches up; the other order would charge it twice.
    pub(crate) fn settle(
        &self,
        ledger: &dyn UsageLedger,
        device: DeviceIndex,
        process_used: u64,
        held: impl FnOnce() -> u64,
        mode: OverLimit,
    ) -> Result<Settled, OutOfMemory> {
        let d = device.as_usize();
        let mut charged = self.lock();
        let Some(current) = charged.get(d).copied() else {
            return Ok(Settled {
                charged: 0,
                over_limit: None,
            });
        };
        let others = held().saturating_sub(current);
        let target = process_used.saturating_sub(others) / DEVICE_PAGE * DEVICE_PAGE;
        let mut over_limit = None;
        if target > current {
            let grow = target - current;
            if let Err(oom) = ledger.try_reserve(device, UsageClass::Module, grow) {
                match mode {
                    OverLimit::Refuse => return Err(oom),
                    OverLimit::Charge => {
                        ledger.charge_over_limit(device, UsageClass::Module, grow);
                        over_limit = Some(oom);
                    }
                }
            }
        } else if target < current {
            ledger.release(device, UsageClass::Module, current - target);
        }
        charged[d] = target;
        if target > 0 {
            self.any_charged.store(true, Ordering::Relaxed);
        }
        Ok(Settled {
            charged: target,
            over_limit,
        })
    }

    /// True the first time only: NVML did not list this process.
    pub(crate) fn first_not_listed(&self) -> bool {
        !self.said_not_listed.swap(true, Ordering::Relaxed)
    }

    /// True the first time only: a residual was charged over the limit.
    pub(crate) fn first_over_limit(&self) -> bool {
        !self.said_over_limit.swap(true, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{D, M, ledger};
    use vgpu_alloc_core::InMemoryLedger;

    fn held(l: &InMemoryLedger) -> impl FnOnce() -> u64 + '_ {
        || l.usage(D).used
    }

    #[test]
    fn the_residual_is_what_nvml_sees_beyond_the_other_charges() {
        let l = ledger(1 << 30);
        let r = Residual::new(Some(100));
        // Context 64 MiB and data 100 MiB charged; NVML sees 200 MiB: 36 MiB are code.
        l.try_reserve(D, UsageClass::Context, 64 * M).unwrap();
        l.try_reserve(D, UsageClass::Data, 100 * M).unwrap();
        let s = r
            .settle(&l, D, 200 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(s.charged, 36 * M);
        assert_eq!(l.usage(D).used, 200 * M);
        assert!(r.any_charged());
        // Nothing changed: settling again charges nothing more (the residual is not counted
        // among the "other" charges).
        r.settle(&l, D, 200 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(l.usage(D).used, 200 * M);
        // A module unloaded: the residual goes down.
        r.settle(&l, D, 180 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!((r.charged(D), l.usage(D).used), (16 * M, 180 * M));
        // Data freed by the program and by the driver together: unchanged residual.
        l.release(D, UsageClass::Data, 50 * M);
        r.settle(&l, D, 130 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!((r.charged(D), l.usage(D).used), (16 * M, 130 * M));
    }

    #[test]
    fn over_charged_elsewhere_clamps_at_zero_and_rounds_down() {
        let l = ledger(1 << 30);
        let r = Residual::new(Some(100));
        l.try_reserve(D, UsageClass::Data, 100 * M).unwrap();
        // Managed memory charged but not resident: NVML sees less than charged.
        let s = r
            .settle(&l, D, 60 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(s.charged, 0);
        assert_eq!(l.usage(D).used, 100 * M);
        // Driver padding of a few hundred bytes is not a residual.
        r.settle(&l, D, 100 * M + 700, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(r.charged(D), 0);
        r.settle(&l, D, 103 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(r.charged(D), 2 * M, "whole 2 MiB units");
    }

    #[test]
    fn over_the_limit_is_charged_anyway_or_refused_for_the_caller_to_undo() {
        let l = ledger(100 * M);
        let r = Residual::new(Some(100));
        l.try_reserve(D, UsageClass::Data, 90 * M).unwrap();
        // Refuse: nothing charged, the caller unloads the module.
        let e = r
            .settle(&l, D, 120 * M, held(&l), OverLimit::Refuse)
            .unwrap_err();
        assert_eq!((e.requested, e.in_use, e.limit), (30 * M, 90 * M, 100 * M));
        assert_eq!((r.charged(D), l.usage(D).used), (0, 90 * M));
        // Charge: the memory is already taken, so it shows above the limit.
        let s = r
            .settle(&l, D, 120 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(s.charged, 30 * M);
        assert!(s.over_limit.is_some());
        assert_eq!(l.usage(D).used, 120 * M);
        assert!(
            l.try_reserve(D, UsageClass::Data, 1).is_err(),
            "further allocations are refused"
        );
        // It shrinks back like any residual.
        r.settle(&l, D, 94 * M, held(&l), OverLimit::Charge)
            .unwrap();
        assert_eq!(l.usage(D).used, 94 * M);
        assert!(r.first_over_limit() && !r.first_over_limit(), "logged once");
    }

    #[test]
    fn devices_are_tracked_while_a_context_or_a_residual_is_there() {
        let l = ledger(1 << 30);
        let r = Residual::new(Some(100));
        let d1 = DeviceIndex(1);
        assert!(!r.tracks(D) && !r.tracks(d1));
        r.context_created(0x10, D);
        r.context_created(0x20, D);
        assert!(r.tracks(D) && !r.tracks(d1));
        r.settle(&l, D, 4 * M, held(&l), OverLimit::Charge).unwrap();
        r.context_gone(0x10);
        r.context_gone(0x20);
        assert!(!r.has_context(D));
        assert!(r.tracks(D), "a residual is still charged");
        r.settle(&l, D, 0, held(&l), OverLimit::Charge).unwrap();
        assert!(!r.tracks(D));
    }

    #[test]
    fn rate_limit_lets_one_settle_through_per_interval() {
        let r = Residual::new(Some(60_000));
        assert!(r.due(), "the first one runs");
        assert!(!r.due(), "then not within the interval");
        let every = Residual::new(Some(0));
        assert!(every.due() && every.due());
        let off = Residual::new(None);
        assert!(!off.enabled() && !off.due());
    }
}
