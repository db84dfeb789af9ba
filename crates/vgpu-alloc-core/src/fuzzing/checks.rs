//! The checks run after every step, and the "everything returned" oracle at the end.

use std::collections::HashMap;

use super::model::Live;
use super::{DEVICES, Harness};
use crate::backend::ContextId;
use crate::ledger::DeviceIndex;
use crate::table::AllocationKind;

impl Harness {
    pub(super) fn check(&self) -> Result<(), String> {
        let a = self.cfg.allocator;
        let stats = self.alloc.stats();
        ensure!(
            stats.live_allocations == self.live.len(),
            "table has {}, model {}",
            stats.live_allocations,
            self.live.len()
        );
        let regions = self.alloc.regions();
        ensure!(regions.len() == stats.regions, "region count");
        for di in 0..DEVICES {
            let d = DeviceIndex(di as u32);
            let own_address: Vec<&Live> = self
                .live
                .iter()
                .filter(|l| {
                    l.device == d && l.kind.is_address() && l.kind != AllocationKind::SubAllocated
                })
                .collect();
            let (dev_count, dev_bytes) = self.alloc.backend().live_on(d);
            let n_regions = dev_count
                .checked_sub(own_address.len())
                .ok_or_else(|| format!("device {d} has fewer allocations than the model"))?;
            ensure!(
                regions.iter().filter(|r| r.device == d).count() == n_regions,
                "device {d}: {n_regions} regions on the device, allocator reports another count"
            );
            let own_bytes: u64 = own_address.iter().map(|l| l.span).sum();
            let region_bytes: u64 = regions
                .iter()
                .filter(|r| r.device == d)
                .map(|r| u64::from(r.chunks) * a.chunk_size)
                .sum();
            ensure!(
                dev_bytes == own_bytes + region_bytes,
                "device {d} bytes {dev_bytes}"
            );
            let charged: u64 = self
                .live
                .iter()
                .filter(|l| l.device == d)
                .map(|l| l.accounted)
                .sum();
            let want = charged + region_bytes;
            let used = self.used(d);
            ensure!(used == want, "device {d}: ledger {used}, model {want}");
            if let Some(l) = self.limit(d) {
                ensure!(used <= l, "device {d}: {used} over limit {l}");
            }
        }
        // At most one empty region per (device, context).
        let mut empties: HashMap<(DeviceIndex, ContextId), usize> = HashMap::new();
        for r in regions.iter().filter(|r| r.free_chunks == r.chunks) {
            *empties.entry((r.device, r.context)).or_default() += 1;
        }
        ensure!(
            empties.values().all(|&n| n <= 1),
            "more than one empty region per context: {empties:?}"
        );
        // No overlap between own allocations and regions.
        let mut spans: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter(|l| l.kind.is_address() && l.kind != AllocationKind::SubAllocated)
            .map(|l| (l.key, l.span))
            .chain(
                regions
                    .iter()
                    .map(|r| (r.base.0, u64::from(r.chunks) * a.chunk_size)),
            )
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            ensure!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
        }
        // Sub-allocations: inside a region of their own device and context, disjoint, and
        // each region's used chunks are exactly theirs.
        let mut used_chunks = vec![0u64; regions.len()];
        let mut subs: Vec<&Live> = self
            .live
            .iter()
            .filter(|l| l.kind == AllocationKind::SubAllocated)
            .collect();
        subs.sort_unstable_by_key(|l| l.key);
        for w in subs.windows(2) {
            ensure!(w[0].key + w[0].span <= w[1].key, "sub-allocations overlap");
        }
        for l in subs {
            ensure!(l.key % a.chunk_size == 0, "unaligned {l:?}");
            let (ri, r) = regions
                .iter()
                .enumerate()
                .find(|(_, r)| {
                    l.key >= r.base.0
                        && l.key + l.span <= r.base.0 + u64::from(r.chunks) * a.chunk_size
                })
                .ok_or_else(|| format!("{l:?} outside every region"))?;
            ensure!(
                (r.device, r.context) == (l.device, l.context),
                "{l:?} in a region of {:?}",
                (r.device, r.context)
            );
            used_chunks[ri] += l.span / a.chunk_size;
        }
        for (r, used) in regions.iter().zip(used_chunks) {
            ensure!(
                u64::from(r.chunks - r.free_chunks) == used,
                "region {} uses {} chunks, model {used}",
                r.base,
                r.chunks - r.free_chunks
            );
        }
        Ok(())
    }

    pub(super) fn finish(&mut self) -> Result<(), String> {
        while !self.live.is_empty() {
            self.free(0)?;
        }
        self.check()?;
        let a = self.cfg.allocator;
        // An injected device failure left unconsumed is not part of the oracle.
        self.alloc.backend().fail_next_allocations(0);
        for di in 0..DEVICES {
            let d = DeviceIndex(di as u32);
            // Warm regions must never stand in the way of a full-size request.
            let full = self.limit(d).unwrap_or(4 * a.region_size);
            let r = self.alloc.allocate(d, ContextId(0), full).map_err(|e| {
                format!("full-size request of {full} on device {d} after freeing all: {e}")
            })?;
            self.alloc.free(r.ptr).map_err(|e| e.to_string())?;
        }
        self.alloc.trim();
        let s = self.alloc.stats();
        ensure!(
            s.regions == 0 && s.live_allocations == 0,
            "left behind: {s:?}"
        );
        for di in 0..DEVICES {
            let d = DeviceIndex(di as u32);
            ensure!(
                self.used(d) == 0,
                "device {d} still charged {}",
                self.used(d)
            );
        }
        ensure!(
            self.alloc.backend().live_allocations() == 0,
            "device allocations leaked"
        );
        Ok(())
    }
}
