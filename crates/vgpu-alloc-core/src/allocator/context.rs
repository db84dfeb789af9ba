//! Context destruction: dropping everything a destroyed context held.

use super::state::{RegionSlot, sub_entry};
use super::{Allocator, ContextReleased};
use crate::backend::{ContextId, DeviceBackend};
use crate::ledger::{UsageClass, UsageLedger};
use crate::table::Placement;

impl<B: DeviceBackend, L: UsageLedger> Allocator<B, L> {
    /// `context` was destroyed: the driver freed its memory, so drop its regions and
    /// entries and release their charge, without calling the device.
    pub fn release_context(&self, context: ContextId) -> ContextReleased {
        let (entries, regions) = {
            let mut st = self.lock();
            let st = &mut *st;
            let mut entries = st.table.drain_context(context);
            let mut rids = Vec::new();
            st.pools.retain(|&(_, c), pool| {
                if c == context {
                    rids.extend_from_slice(&pool.regions);
                }
                c != context
            });
            // Their sub-allocations go with them (reported, nothing more to release).
            for &rid in &rids {
                if let Some(slot) = st.regions.get(rid) {
                    let shift = self.chunk_shift;
                    entries.extend(
                        slot.region
                            .sized_runs()
                            .map(|(start, req)| sub_entry(rid, slot, start, req, shift)),
                    );
                }
            }
            let regions: Vec<RegionSlot> =
                rids.into_iter().filter_map(|r| st.take_region(r)).collect();
            (entries, regions)
        };
        let mut out = ContextReleased {
            allocations: entries.len(),
            regions: regions.len(),
            released: 0,
        };
        for e in entries.iter().filter(|e| e.placement == Placement::Own) {
            self.ledger
                .release(e.device, e.kind.usage_class(), e.accounted);
            out.released += e.accounted;
        }
        for slot in &regions {
            let bytes = slot.bytes(self.chunk_shift);
            self.ledger.release(slot.device, UsageClass::Data, bytes);
            out.released += bytes;
        }
        out
    }
}
