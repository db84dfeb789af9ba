//! Sub-allocation: serving small requests from regions, freeing them, giving regions back.

use std::sync::MutexGuard;

use super::state::{RegionSlot, sub_entry};
use super::{AllocError, Allocated, Allocator, FreeError, Freed, State};
use crate::backend::{ContextId, DeviceBackend, DevicePtr};
use crate::ledger::{DeviceIndex, DeviceUsage, UsageClass, UsageLedger};
use crate::region::{Region, chunks_for};
use crate::table::AllocationKind;

impl<B: DeviceBackend, L: UsageLedger> Allocator<B, L> {
    /// Serve `bytes` from an existing region of the context. The region's bitmap and
    /// size array are the whole record: no table entry, so a burst of small allocations
    /// grows nothing but bits.
    pub(super) fn suballoc_existing(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u32,
    ) -> Option<Allocated> {
        let count = chunks_for(bytes, self.chunk_shift);
        let mut st = self.lock();
        let st = &mut *st;
        let pool = st.pools.get_mut(&(device, context))?;
        let n = pool.regions.len();
        // `current` < n (every change to the pool resets or sets it): a compare, not a
        // division (tens of cycles), wraps the index.
        let from = pool.current.min(n.saturating_sub(1));
        for k in 0..n {
            let i = if from + k < n { from + k } else { from + k - n };
            let rid = pool.regions[i];
            // A pool never names a missing region (they leave together); skip if it did.
            let Some(slot) = st.regions.get_mut(rid) else {
                continue;
            };
            if slot.region.free_chunks() < count {
                continue;
            }
            if let Some(start) = slot.region.allocate_sized(bytes) {
                pool.current = i;
                return Some(Allocated {
                    ptr: slot.region.address_of(start),
                    kind: AllocationKind::SubAllocated,
                    accounted: u64::from(count) << self.chunk_shift,
                });
            }
        }
        None
    }

    /// Bytes of a new region for a request of `bytes` in `(device, context)`, or `None`
    /// when not even one that holds the request fits the limit. Regions grow with use and
    /// shrink to the limit: the first of a context is one page (the threshold rounded up
    /// to ALIGN), each next one doubles the largest the context holds, up to OVERSIZE; and
    /// none is larger than what remains under the limit. So the memory held but not yet
    /// used stays below what the context already uses (plus one page), and small requests
    /// can fill a limit to within one page. Cold: runs once per region.
    #[cold]
    pub(super) fn new_region_size(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u32,
    ) -> Option<u64> {
        let cfg = &self.config;
        // Whole pages (the driver's granularity), and whole chunks.
        let page = cfg.align.max(cfg.chunk_size);
        let chunked = u64::from(chunks_for(bytes, self.chunk_shift)) << self.chunk_shift;
        let need = chunked.next_multiple_of(page).min(cfg.region_size);
        let first = cfg
            .suballoc_threshold
            .next_multiple_of(page)
            .min(cfg.region_size);
        let largest = {
            let st = self.lock();
            st.pools.get(&(device, context)).map_or(0, |pool| {
                pool.regions
                    .iter()
                    .filter_map(|&r| st.regions.get(r))
                    .map(|slot| slot.bytes(self.chunk_shift))
                    .max()
                    .unwrap_or(0)
            })
        };
        let want = largest
            .saturating_mul(2)
            .clamp(first, cfg.region_size)
            .max(need);
        let room = |usage: DeviceUsage| {
            usage.limit.map_or(u64::MAX, |l| {
                let left = l.saturating_sub(usage.used);
                left - left % page
            })
        };
        let mut left = room(self.ledger.usage(device));
        if left < need && self.evict_empty_regions(Some(device)) > 0 {
            left = room(self.ledger.usage(device));
        }
        (left >= need).then(|| want.min(left))
    }

    pub(super) fn suballoc_new_region(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u32,
    ) -> Result<Option<Allocated>, AllocError> {
        let Some(size) = self.new_region_size(device, context, bytes) else {
            return Ok(None);
        };
        let Ok(reservation) = self.reserve(device, UsageClass::Data, size) else {
            return Ok(None);
        };
        let Ok(base) = self.backend.allocate(device, context, size) else {
            // The device cannot give the region; a direct allocation may still fit.
            return Ok(None);
        };
        // Cannot truncate: size <= OVERSIZE, whose chunk count fits u32 (checked by the
        // config), and size is a whole number of chunks.
        let mut region = Region::new(base, self.chunk_shift, (size >> self.chunk_shift) as u32);
        let Some(start) = region.allocate_sized(bytes) else {
            drop(reservation);
            let _ = self.backend.free(device, context, base);
            return Err(AllocError::Internal(
                "a new region cannot hold a sub-threshold request",
            ));
        };
        let mut st = self.lock();
        let rid = st.attach(RegionSlot {
            region,
            device,
            context,
        });
        if let Some(pool) = st.pools.get_mut(&(device, context)) {
            // Serve the next requests from the new region first.
            pool.current = pool.regions.len() - 1;
        }
        // The region now owns its bytes; they go back when the region does.
        reservation.commit();
        let ptr = st
            .regions
            .get(rid)
            .map(|slot| slot.region.address_of(start))
            .ok_or(AllocError::Internal("region vanished under the lock"))?;
        Ok(Some(Allocated {
            ptr,
            kind: AllocationKind::SubAllocated,
            accounted: u64::from(chunks_for(bytes, self.chunk_shift)) << self.chunk_shift,
        }))
    }

    /// Free the sub-allocation whose base is `ptr` (`NotTracked` for any other address in
    /// a region: free space, an interior pointer, a double free). Gives the region back
    /// when it was the last run and another empty region is kept warm. Always inlined:
    /// the call's frame cost a fifth of a sub-allocated free.
    #[inline(always)]
    pub(super) fn free_suballocation(
        &self,
        mut st: MutexGuard<'_, State>,
        ptr: DevicePtr,
        region: usize,
        chunk: u32,
    ) -> Result<Freed, FreeError> {
        let shift = self.chunk_shift;
        let Some(slot) = st.regions.get_mut(region) else {
            return Err(FreeError::Internal("region vanished under the lock"));
        };
        if slot.region.address_of(chunk) != ptr {
            return Err(FreeError::NotTracked); // inside a chunk: not an allocation's base
        }
        // Not the start of a live run: free space, an interior chunk, a double free.
        if slot.region.requested_at(chunk).is_none() {
            return Err(FreeError::NotTracked);
        }
        let (requested, _) = slot
            .region
            .free_sized(chunk)
            .map_err(|_| FreeError::Internal("sub-allocation chunks were not in use"))?;
        let entry = sub_entry(region, slot, chunk, requested, shift);
        let surplus = st.detach_if_surplus(region);
        drop(st);
        let released = match surplus {
            Some(slot) => self.free_region(slot),
            None => 0,
        };
        Ok(Freed {
            allocation: entry,
            released,
        })
    }

    /// Give a detached region back to the device and its bytes to the ledger; if the
    /// device refuses, re-attach it so its bytes stay charged. Returns bytes released.
    pub(super) fn free_region(&self, slot: RegionSlot) -> u64 {
        match self
            .backend
            .free(slot.device, slot.context, slot.region.base())
        {
            Ok(()) => {
                let bytes = slot.bytes(self.chunk_shift);
                self.ledger.release(slot.device, UsageClass::Data, bytes);
                bytes
            }
            Err(_) => {
                let mut st = self.lock();
                st.region_free_failures += 1;
                let _ = st.attach(slot);
                0
            }
        }
    }

    pub(super) fn evict_empty_regions(&self, device: Option<DeviceIndex>) -> usize {
        let victims = self.lock().detach_empty(device);
        victims
            .into_iter()
            .map(|slot| self.free_region(slot))
            .filter(|&b| b > 0)
            .count()
    }
}
