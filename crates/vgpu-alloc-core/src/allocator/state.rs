//! The state behind the allocator's mutex: the table, the regions and their pools.

use crate::backend::{ContextId, DevicePtr};
use crate::ledger::DeviceIndex;
use crate::region::{Region, chunks_for};
use crate::table::{Allocation, AllocationKind, AllocationTable, IdHashMap, Placement};

/// A sub-allocation described as a table entry (it has none: its region holds it).
#[inline]
pub(super) fn sub_entry(
    rid: usize,
    slot: &RegionSlot,
    start: u32,
    requested: u32,
    shift: u32,
) -> Allocation {
    let count = chunks_for(requested, shift);
    Allocation {
        kind: AllocationKind::SubAllocated,
        key: slot.region.address_of(start).0,
        device: slot.device,
        context: slot.context,
        requested: u64::from(requested),
        accounted: 0,
        placement: Placement::Chunks {
            region: rid,
            start,
            count,
        },
    }
}

#[derive(Debug)]
pub(super) struct RegionSlot {
    pub(super) region: Region,
    pub(super) device: DeviceIndex,
    pub(super) context: ContextId,
}

impl RegionSlot {
    /// Bytes the region holds from the device (and is charged).
    pub(super) fn bytes(&self, chunk_shift: u32) -> u64 {
        u64::from(self.region.chunks()) << chunk_shift
    }
}

#[derive(Debug, Default)]
pub(super) struct Pool {
    pub(super) regions: Vec<usize>,
    pub(super) current: usize,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) table: AllocationTable,
    pub(super) regions: slab::Slab<RegionSlot>,
    /// Region base address -> slot, sorted by base, to find the region of any address
    /// (a binary search over a few entries: a handful of growing regions, then one per
    /// 128 MiB in use).
    pub(super) region_bases: Vec<(u64, usize)>,
    pub(super) pools: IdHashMap<(DeviceIndex, ContextId), Pool>,
    pub(super) stale_replaced: u64,
    pub(super) region_free_failures: u64,
}

impl State {
    pub(super) fn add_region(&mut self, slot: RegionSlot) -> usize {
        let base = slot.region.base().0;
        let rid = self.regions.insert(slot);
        let at = self.region_bases.partition_point(|&(b, _)| b < base);
        self.region_bases.insert(at, (base, rid));
        rid
    }

    pub(super) fn take_region(&mut self, rid: usize) -> Option<RegionSlot> {
        let slot = self.regions.try_remove(rid)?;
        let base = slot.region.base().0;
        if let Ok(at) = self.region_bases.binary_search_by_key(&base, |&(b, _)| b) {
            self.region_bases.remove(at);
        }
        Some(slot)
    }

    /// The region whose memory contains `addr`, with its slot id and `addr`'s chunk.
    #[inline]
    pub(super) fn region_at(
        &self,
        addr: u64,
        chunk_shift: u32,
    ) -> Option<(usize, &RegionSlot, u32)> {
        let at = self.region_bases.partition_point(|&(b, _)| b <= addr);
        let &(base, rid) = self.region_bases.get(at.checked_sub(1)?)?;
        let slot = self.regions.get(rid)?;
        slot.region
            .contains(DevicePtr(addr))
            .then(|| (rid, slot, ((addr - base) >> chunk_shift) as u32))
    }

    /// The sub-allocation whose first byte is `addr`, as a table-style entry.
    pub(super) fn suballocation_at(&self, addr: u64, chunk_shift: u32) -> Option<Allocation> {
        let (rid, slot, chunk) = self.region_at(addr, chunk_shift)?;
        if slot.region.address_of(chunk).0 != addr {
            return None;
        }
        let requested = slot.region.requested_at(chunk)?;
        Some(sub_entry(rid, slot, chunk, requested, chunk_shift))
    }

    /// Live sub-allocations in all regions (diagnostics).
    pub(super) fn suballocations(&self, chunk_shift: u32) -> impl Iterator<Item = Allocation> + '_ {
        self.regions.iter().flat_map(move |(rid, slot)| {
            slot.region
                .sized_runs()
                .map(move |(start, req)| sub_entry(rid, slot, start, req, chunk_shift))
        })
    }

    /// Detach `rid` from its pool if it is empty and the pool already has another
    /// empty region (keep at most one warm per context). Inline for the common case, a
    /// region still in use after the free; the pool scan is out of line.
    #[inline]
    pub(super) fn detach_if_surplus(&mut self, rid: usize) -> Option<RegionSlot> {
        if !self.regions.get(rid)?.region.is_empty() {
            return None;
        }
        self.detach_empty_surplus(rid)
    }

    #[cold]
    pub(super) fn detach_empty_surplus(&mut self, rid: usize) -> Option<RegionSlot> {
        let slot = self.regions.get(rid)?;
        let key = (slot.device, slot.context);
        let pool = self.pools.get_mut(&key)?;
        let regions = &self.regions;
        let other_empty = pool
            .regions
            .iter()
            .any(|&r| r != rid && regions.get(r).is_some_and(|s| s.region.is_empty()));
        if !other_empty {
            return None;
        }
        pool.regions.retain(|&r| r != rid);
        pool.current = 0;
        self.take_region(rid)
    }

    /// Detach every empty region (of `device`, or all), for eviction under pressure.
    pub(super) fn detach_empty(&mut self, device: Option<DeviceIndex>) -> Vec<RegionSlot> {
        let mut victims = Vec::new();
        for (&(d, _), pool) in self.pools.iter_mut() {
            if device.is_some_and(|want| want != d) {
                continue;
            }
            let regions = &self.regions;
            pool.regions.retain(|&r| {
                let empty = regions.get(r).is_some_and(|s| s.region.is_empty());
                if empty {
                    victims.push(r);
                }
                !empty
            });
            pool.current = 0;
        }
        self.pools.retain(|_, p| !p.regions.is_empty());
        victims
            .into_iter()
            .filter_map(|r| self.take_region(r))
            .collect()
    }

    /// Add a region to its pool; returns its slot.
    pub(super) fn attach(&mut self, slot: RegionSlot) -> usize {
        let key = (slot.device, slot.context);
        let rid = self.add_region(slot);
        self.pools.entry(key).or_default().regions.push(rid);
        rid
    }
}
