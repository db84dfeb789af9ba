//! Read-only views: address lookups, counters, regions, snapshots.

use super::{AddressRange, Allocator, AllocatorStats, RegionInfo};
use crate::backend::{DeviceBackend, DevicePtr};
use crate::ledger::UsageLedger;
use crate::table::{Allocation, AllocationKind};

impl<B: DeviceBackend, L: UsageLedger> Allocator<B, L> {
    /// The address allocation containing `addr` (`cuMemGetAddressRange`); `None` when
    /// untracked, including free space inside a region. Logarithmic: one range query
    /// among allocations with their own driver allocation, else one among regions and a
    /// bounded bitmap scan inside the region.
    pub fn containing(&self, addr: DevicePtr) -> Option<AddressRange> {
        let st = self.lock();
        let a = match st.region_at(addr.0, self.chunk_shift) {
            Some((_, slot, chunk)) => {
                let region = &slot.region;
                let start = region.run_start_at_or_before(chunk, self.max_run_chunks)?;
                let a = st.suballocation_at(region.address_of(start).0, self.chunk_shift)?;
                if addr.0 - a.key >= a.requested.max(1) {
                    return None;
                }
                a
            }
            None => *st.table.containing(addr)?.1,
        };
        Some(AddressRange {
            base: a.ptr(),
            size: a.requested,
            kind: a.kind,
            device: a.device,
            context: a.context,
        })
    }

    /// The entry `(kind, key)`, if tracked.
    pub fn lookup(&self, kind: AllocationKind, key: u64) -> Option<Allocation> {
        let st = self.lock();
        if kind == AllocationKind::SubAllocated {
            st.suballocation_at(key, self.chunk_shift)
        } else if kind.is_address() {
            st.table
                .get_address(DevicePtr(key))
                .map(|(_, a)| *a)
                .filter(|a| a.kind == kind)
        } else {
            st.table.get_handle(kind, key).map(|(_, a)| *a)
        }
    }

    /// Counters.
    pub fn stats(&self) -> AllocatorStats {
        let st = self.lock();
        AllocatorStats {
            live_allocations: st.table.len()
                + st.regions
                    .iter()
                    .map(|(_, s)| s.region.live_runs())
                    .sum::<usize>(),
            regions: st.regions.len(),
            empty_regions: st
                .regions
                .iter()
                .filter(|(_, s)| s.region.is_empty())
                .count(),
            stale_replaced: st.stale_replaced,
            region_free_failures: st.region_free_failures,
        }
    }

    /// The region whose memory contains `addr`, if any (O(log regions), no allocation):
    /// an untracked address inside a region is a double free or an interior pointer, which
    /// must not reach the driver.
    pub fn region_containing(&self, addr: DevicePtr) -> Option<RegionInfo> {
        let st = self.lock();
        let (_, s, _) = st.region_at(addr.0, self.chunk_shift)?;
        Some(RegionInfo {
            device: s.device,
            context: s.context,
            base: s.region.base(),
            chunks: s.region.chunks(),
            free_chunks: s.region.free_chunks(),
        })
    }

    /// Every region held (tests, diagnostics; O(regions)).
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.lock()
            .regions
            .iter()
            .map(|(_, s)| RegionInfo {
                device: s.device,
                context: s.context,
                base: s.region.base(),
                chunks: s.region.chunks(),
                free_chunks: s.region.free_chunks(),
            })
            .collect()
    }

    /// A copy of every live entry (tests, diagnostics; O(n)).
    pub fn snapshot(&self) -> Vec<Allocation> {
        let st = self.lock();
        st.table
            .iter()
            .map(|(_, a)| *a)
            .chain(st.suballocations(self.chunk_shift))
            .collect()
    }
}
