//! The direct path: allocations with their own table entry, made by the allocator or
//! recorded for the hook, and their removal.

use std::sync::MutexGuard;

use super::{AllocError, Allocated, Allocator, FreeError, Freed, State};
use crate::backend::{ContextId, DeviceBackend};
use crate::ledger::{DeviceIndex, Reservation, UsageClass, UsageLedger};
use crate::table::{AllocId, Allocation, AllocationKind, Placement};

impl<B: DeviceBackend, L: UsageLedger> Allocator<B, L> {
    pub(super) fn allocate_direct(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u64,
    ) -> Result<Allocated, AllocError> {
        let accounted = bytes
            .checked_next_multiple_of(self.config.align)
            .ok_or(AllocError::SizeOverflow { requested: bytes })?;
        let reservation = self.reserve(device, UsageClass::Data, accounted)?;
        let ptr = self.backend.allocate(device, context, bytes)?;
        let entry = Allocation {
            kind: AllocationKind::Direct,
            key: ptr.0,
            device,
            context,
            requested: bytes,
            accounted,
            placement: Placement::Own,
        };
        let mut st = self.lock();
        match self.insert_entry(&mut st, entry) {
            Ok(_) => {
                reservation.commit();
                Ok(Allocated {
                    ptr,
                    kind: AllocationKind::Direct,
                    accounted,
                })
            }
            Err(e) => {
                drop(st);
                let _ = self.backend.free(device, context, ptr);
                Err(e)
            }
        }
    }

    /// Insert, replacing a stale entry with the same key: the driver just handed the key
    /// out again, so whatever the table held under it was freed behind our back.
    pub(super) fn insert_entry(
        &self,
        st: &mut State,
        entry: Allocation,
    ) -> Result<AllocId, AllocError> {
        if entry.kind.is_address() && st.region_at(entry.key, self.chunk_shift).is_some() {
            // The driver handed out an address inside one of our regions: it cannot,
            // unless the regions are corrupt.
            return Err(AllocError::Internal(
                "new allocation overlaps a sub-allocator region",
            ));
        }
        if let Ok(id) = st.table.insert(entry) {
            return Ok(id);
        }
        let old = if entry.kind.is_address() {
            st.table.remove_address(entry.ptr())
        } else {
            st.table.remove_handle(entry.kind, entry.key)
        };
        match old {
            Some(old) if old.placement == Placement::Own => {
                self.ledger
                    .release(old.device, old.kind.usage_class(), old.accounted);
                st.stale_replaced += 1;
            }
            Some(old) => {
                // Only allocations with their own placement are in the table.
                let _ = st.table.insert(old);
                return Err(AllocError::Internal("table holds a sub-allocation"));
            }
            None => return Err(AllocError::Internal("duplicate key not found")),
        }
        st.table
            .insert(entry)
            .map_err(|_| AllocError::Internal("duplicate key after removal"))
    }

    pub(super) fn finish_removal(
        &self,
        mut st: MutexGuard<'_, State>,
        entry: Allocation,
        call_device: bool,
    ) -> Result<Freed, FreeError> {
        match entry.placement {
            Placement::Chunks { .. } => {
                // Only allocations with their own placement are in the table.
                let _ = st.table.insert(entry);
                Err(FreeError::Internal("table holds a sub-allocation"))
            }
            Placement::Own => {
                drop(st);
                if call_device {
                    if let Err(e) = self.backend.free(entry.device, entry.context, entry.ptr()) {
                        let mut st = self.lock();
                        if st.table.insert(entry).is_err() {
                            // The driver reused the address meanwhile: ours is gone.
                            self.ledger.release(
                                entry.device,
                                entry.kind.usage_class(),
                                entry.accounted,
                            );
                        }
                        return Err(FreeError::Backend(e));
                    }
                }
                self.ledger
                    .release(entry.device, entry.kind.usage_class(), entry.accounted);
                Ok(Freed {
                    allocation: entry,
                    released: entry.accounted,
                })
            }
        }
    }

    /// Reserve for an allocation the hook performs itself (managed, pitched, async,
    /// VMM handle, array, graph, context, module): the charge is taken now; call the
    /// driver, then [`PendingRecord::commit`] with the key it returned. Dropping the
    /// pending record (driver failed) gives the charge back.
    pub fn begin_record(
        &self,
        kind: AllocationKind,
        device: DeviceIndex,
        context: ContextId,
        requested: u64,
        accounted: u64,
    ) -> Result<PendingRecord<'_, B, L>, AllocError> {
        if kind == AllocationKind::SubAllocated {
            return Err(AllocError::InvalidValue(
                "sub-allocations are made by allocate()",
            ));
        }
        if !self.ledger.has_device(device) {
            return Err(AllocError::InvalidValue("device index out of range"));
        }
        let reservation = self.reserve(device, kind.usage_class(), accounted)?;
        Ok(PendingRecord {
            allocator: self,
            reservation,
            kind,
            device,
            context,
            requested,
        })
    }
}

/// A charge taken for an allocation the hook is about to make (see
/// [`Allocator::begin_record`]).
#[derive(Debug)]
#[must_use = "dropping a pending record gives its charge back; commit() once the driver succeeded"]
pub struct PendingRecord<'a, B: DeviceBackend, L: UsageLedger> {
    allocator: &'a Allocator<B, L>,
    reservation: Reservation<'a>,
    kind: AllocationKind,
    device: DeviceIndex,
    context: ContextId,
    requested: u64,
}

impl<B: DeviceBackend, L: UsageLedger> PendingRecord<'_, B, L> {
    /// Bytes charged.
    pub fn accounted(&self) -> u64 {
        self.reservation.bytes()
    }

    /// Change the charge to `accounted` (e.g. a pitched allocation's estimate corrected
    /// with the real pitch) without holding two charges at once. Growing may give warm
    /// empty regions back first, like any reservation.
    pub fn resize(&mut self, accounted: u64) -> Result<(), AllocError> {
        match self.reservation.resize(accounted) {
            Ok(()) => Ok(()),
            Err(oom) => {
                if self.allocator.evict_empty_regions(Some(self.device)) == 0 {
                    return Err(oom.into());
                }
                self.reservation.resize(accounted).map_err(Into::into)
            }
        }
    }

    /// The driver succeeded and returned `key` (address or handle): track it.
    pub fn commit(self, key: u64) -> Result<AllocId, AllocError> {
        let entry = Allocation {
            kind: self.kind,
            key,
            device: self.device,
            context: self.context,
            requested: self.requested,
            accounted: self.reservation.bytes(),
            placement: Placement::Own,
        };
        let mut st = self.allocator.lock();
        let id = self.allocator.insert_entry(&mut st, entry)?;
        self.reservation.commit();
        Ok(id)
    }
}
