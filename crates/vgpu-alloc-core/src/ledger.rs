//! The reserve-or-OOM decision: a usage ledger that adds reservations up against a limit.
//!
//! [`UsageLedger`] is implemented in memory here ([`InMemoryLedger`]: one process, or one
//! scheduler's view of its devices) and across processes by `vgpu-shm` (HAMi's shared
//! file). A [`Reservation`] that is not committed releases itself on drop, so an
//! allocation that fails in the driver after its bytes were reserved never leaks usage.
//!
//! Devices are plain indices; a ledger accounts for as many as it was built with
//! ([`UsageLedger::has_device`]). Nothing here is bound to HAMi's 16 device slots.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The device slots of HAMi-core's shared file (16): what vgpu's environment schema and
/// the shared file index. The allocator and the ledgers here take any number of devices.
pub const MAX_DEVICES: usize = 16;

/// A CUDA device ordinal as the *process* sees it (after `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceIndex(pub u32);

impl DeviceIndex {
    /// The index as a `usize`, for indexing per-device storage.
    pub fn as_usize(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for DeviceIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a reserved byte is used for; HAMi's monitor reads these as separate fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UsageClass {
    /// Context (and its internal heaps) memory.
    Context,
    /// Module (code and globals) memory.
    Module,
    /// Data: allocations the program asked for.
    Data,
}

/// A refused reservation: what a user sees in one log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of memory on device {device}: requested {requested} bytes, {in_use} bytes in use, limit {limit} bytes"
)]
pub struct OutOfMemory {
    /// The device asked for.
    pub device: DeviceIndex,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes already in use on that device (all processes sharing the ledger).
    pub in_use: u64,
    /// The device's limit in bytes.
    pub limit: u64,
}

/// Usage and limit of one device as the ledger sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceUsage {
    /// Bytes reserved on the device by everyone sharing the ledger.
    pub used: u64,
    /// The limit in bytes, `None` for unlimited.
    pub limit: Option<u64>,
}

/// Atomic reserve/release of device bytes against a per-device limit.
///
/// Implementations must never let concurrent reservations together exceed the limit,
/// and a refused reservation must change nothing.
pub trait UsageLedger: Send + Sync {
    /// Reserve `bytes` on `device` for `class`, or refuse with [`OutOfMemory`].
    fn try_reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<(), OutOfMemory>;
    /// Return `bytes` previously reserved on `device` for `class`.
    fn release(&self, device: DeviceIndex, class: UsageClass, bytes: u64);
    /// Current usage and limit of `device`.
    fn usage(&self, device: DeviceIndex) -> DeviceUsage;
    /// Whether `device` is one this ledger accounts for; the allocator refuses requests
    /// for any other as invalid before reserving anything. The default says every device
    /// (then [`try_reserve`](Self::try_reserve) decides).
    fn has_device(&self, device: DeviceIndex) -> bool {
        let _ = device;
        true
    }
    /// Record `bytes` on `device` for `class` that are *already* taken, whatever the limit
    /// says: memory the driver took on its own and that was measured after the fact (lazily
    /// loaded code, driver-internal heaps). Never refused, so the usage may end up above the
    /// limit; later reservations are then refused until it drops. Released with
    /// [`release`](Self::release) like any reservation.
    fn charge_over_limit(&self, device: DeviceIndex, class: UsageClass, bytes: u64);
}

/// Reserved bytes not yet committed; dropping it gives them back.
#[must_use = "a reservation is released when dropped; call commit() once the allocation succeeded"]
pub struct Reservation<'a> {
    ledger: &'a dyn UsageLedger,
    device: DeviceIndex,
    class: UsageClass,
    bytes: u64,
}

impl fmt::Debug for Reservation<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("device", &self.device)
            .field("class", &self.class)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl<'a> Reservation<'a> {
    /// Reserve `bytes` on `device` in `ledger`. Inlined so that a caller holding the concrete
    /// ledger calls it directly (every allocation's path).
    #[inline]
    pub fn new(
        ledger: &'a dyn UsageLedger,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<Self, OutOfMemory> {
        ledger.try_reserve(device, class, bytes)?;
        Ok(Self {
            ledger,
            device,
            class,
            bytes,
        })
    }

    /// Bytes held by this reservation.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Change the reserved amount to `bytes` (an estimate corrected once the driver
    /// answered): growing reserves the difference (refused as [`OutOfMemory`] for the
    /// difference, leaving the reservation as it was), shrinking releases it.
    pub fn resize(&mut self, bytes: u64) -> Result<(), OutOfMemory> {
        if bytes > self.bytes {
            self.ledger
                .try_reserve(self.device, self.class, bytes - self.bytes)?;
        } else if bytes < self.bytes {
            self.ledger
                .release(self.device, self.class, self.bytes - bytes);
        }
        self.bytes = bytes;
        Ok(())
    }

    /// Keep the bytes reserved: the allocation they pay for now exists. The caller
    /// releases them through the ledger when the allocation is freed.
    pub fn commit(self) {
        std::mem::forget(self);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.ledger.release(self.device, self.class, self.bytes);
    }
}

/// A process-local ledger: the same protocol as the shared file (atomic reserve against a
/// limit), for one process, one scheduler's view of its devices, or tests.
#[derive(Debug)]
pub struct InMemoryLedger {
    used: Box<[AtomicU64]>,
    limits: Box<[Option<u64>]>,
}

impl InMemoryLedger {
    /// A ledger of one device per entry of `limits`: device `i` is limited to `limits[i]`
    /// bytes (`None` = unlimited). Other device indices are not accounted for
    /// ([`UsageLedger::has_device`]) and every reservation on them is refused.
    pub fn new(limits: impl IntoIterator<Item = Option<u64>>) -> Self {
        let limits: Box<[Option<u64>]> = limits.into_iter().collect();
        Self {
            used: limits.iter().map(|_| AtomicU64::new(0)).collect(),
            limits,
        }
    }

    /// Devices accounted for (indices `0..devices()`).
    pub fn devices(&self) -> usize {
        self.limits.len()
    }
}

impl UsageLedger for InMemoryLedger {
    fn try_reserve(
        &self,
        device: DeviceIndex,
        _class: UsageClass,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        let i = device.as_usize();
        let limit = self.limits.get(i).copied().flatten().unwrap_or(u64::MAX);
        let Some(used) = self.used.get(i) else {
            return Err(OutOfMemory {
                device,
                requested: bytes,
                in_use: 0,
                limit: 0,
            });
        };
        // Compare-and-swap loop: the check and the add are one atomic step.
        used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
            cur.checked_add(bytes).filter(|&next| next <= limit)
        })
        .map(|_| ())
        .map_err(|cur| OutOfMemory {
            device,
            requested: bytes,
            in_use: cur,
            limit,
        })
    }

    fn release(&self, device: DeviceIndex, _class: UsageClass, bytes: u64) {
        if let Some(used) = self.used.get(device.as_usize()) {
            // Saturate: an unbalanced release is a bug elsewhere, not a reason to wrap.
            let _ = used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                Some(cur.saturating_sub(bytes))
            });
        }
    }

    fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        let i = device.as_usize();
        DeviceUsage {
            used: self.used.get(i).map_or(0, |u| u.load(Ordering::Acquire)),
            limit: self.limits.get(i).copied().flatten(),
        }
    }

    fn has_device(&self, device: DeviceIndex) -> bool {
        device.as_usize() < self.limits.len()
    }

    fn charge_over_limit(&self, device: DeviceIndex, _class: UsageClass, bytes: u64) {
        if let Some(used) = self.used.get(device.as_usize()) {
            let _ = used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                Some(cur.saturating_add(bytes))
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_accounts_for_as_many_devices_as_it_has_limits() {
        let ledger = InMemoryLedger::new([Some(10), None, Some(5)]);
        assert_eq!(ledger.devices(), 3);
        assert!(ledger.has_device(DeviceIndex(2)) && !ledger.has_device(DeviceIndex(3)));
        assert!(
            ledger
                .try_reserve(DeviceIndex(1), UsageClass::Data, u64::MAX)
                .is_ok()
        );
        let refused = ledger.try_reserve(DeviceIndex(3), UsageClass::Data, 1);
        assert_eq!(refused.map_err(|e| e.limit), Err(0));
        assert_eq!(ledger.usage(DeviceIndex(40)), DeviceUsage::default());
    }

    #[test]
    fn reservation_releases_on_drop_and_keeps_on_commit() {
        let ledger = InMemoryLedger::new([Some(100)]);
        let d = DeviceIndex(0);
        {
            let r = Reservation::new(&ledger, d, UsageClass::Data, 60).unwrap();
            assert_eq!(r.bytes(), 60);
            assert_eq!(ledger.usage(d).used, 60);
            let err = Reservation::new(&ledger, d, UsageClass::Data, 41).unwrap_err();
            assert_eq!(
                err,
                OutOfMemory {
                    device: d,
                    requested: 41,
                    in_use: 60,
                    limit: 100
                }
            );
        }
        assert_eq!(ledger.usage(d).used, 0);
        Reservation::new(&ledger, d, UsageClass::Data, 100)
            .unwrap()
            .commit();
        assert_eq!(ledger.usage(d).used, 100);
        ledger.release(d, UsageClass::Data, 100);
        assert_eq!(
            ledger.usage(d),
            DeviceUsage {
                used: 0,
                limit: Some(100)
            }
        );
    }

    #[test]
    fn reservation_resizes_within_the_limit() {
        let ledger = InMemoryLedger::new([Some(100)]);
        let d = DeviceIndex(0);
        let mut r = Reservation::new(&ledger, d, UsageClass::Data, 60).unwrap();
        r.resize(90).unwrap();
        assert_eq!(ledger.usage(d).used, 90);
        let err = r.resize(101).unwrap_err();
        assert_eq!((err.requested, err.in_use), (11, 90));
        assert_eq!(
            (r.bytes(), ledger.usage(d).used),
            (90, 90),
            "a refused resize changes nothing"
        );
        r.resize(10).unwrap();
        assert_eq!(ledger.usage(d).used, 10);
        drop(r);
        assert_eq!(ledger.usage(d).used, 0);
    }

    #[test]
    fn a_charge_over_the_limit_is_recorded_and_blocks_later_reservations() {
        let ledger = InMemoryLedger::new([Some(100)]);
        let d = DeviceIndex(0);
        ledger.try_reserve(d, UsageClass::Data, 80).unwrap();
        ledger.charge_over_limit(d, UsageClass::Module, 40);
        assert_eq!(ledger.usage(d).used, 120, "memory already taken is shown");
        assert!(ledger.try_reserve(d, UsageClass::Data, 1).is_err());
        ledger.release(d, UsageClass::Module, 40);
        assert!(ledger.try_reserve(d, UsageClass::Data, 20).is_ok());
    }
}
