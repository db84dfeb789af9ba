//! What the unit tests share: a ledger whose device 0 has a limit.

use vgpu_alloc_core::{DeviceIndex, InMemoryLedger, MAX_DEVICES};

/// One MiB.
pub(crate) const M: u64 = 1 << 20;
/// The limited device.
pub(crate) const D: DeviceIndex = DeviceIndex(0);

/// A ledger with `limit` bytes on [`D`] and no limit elsewhere.
pub(crate) fn ledger(limit: u64) -> InMemoryLedger {
    let mut l = [None; MAX_DEVICES];
    l[0] = Some(limit);
    InMemoryLedger::new(l)
}
