//! The protocol's view of the mapped file ([`Store`]) and HAMi's per-slot mirror: every write
//! of HAMi's `procs[]` happens here, under a device lock or the administrative lock.

use std::fs::File;
use std::sync::atomic::Ordering;

use crate::layout::{
    CLASSES, Extension, HAMI_STATUS_RUNNING, HOST_FLAG_OVERSUBSCRIBE, HamiProcSlot, HamiRegion,
    HostHeld, MAX_DEVICES, MAX_SLOTS, SlotRecord,
};
use crate::protocol::{HostPolicy, STATE_LIVE, Store, split_ident};
use crate::sys;

use super::{ADMIN_LOCK_OFFSET, SLOT_LOCK_BASE};

/// The protocol's view of the mapped file.
pub(crate) struct Mapped<'a> {
    pub(super) region: &'a HamiRegion,
    pub(super) ext: &'a Extension,
    /// The host-backed class (minor version 2). Absent only from a read-only view of an older
    /// file, which holds no host bytes (a writable attach upgrades the file first).
    pub(super) host: Option<&'a HostHeld>,
    pub(super) probe: &'a File,
}

/// What the host class reads as in a file without it: nothing held. Never written: only a
/// read-only view lacks the part, and the protocol writes through writable handles only.
static NO_HOST_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl<'a> Mapped<'a> {
    /// A view of `region`, `ext` and (when the file has it) `host` whose liveness questions go
    /// to `probe` (a descriptor of the same file that never holds locks).
    pub(crate) fn new(
        region: &'a HamiRegion,
        ext: &'a Extension,
        host: Option<&'a HostHeld>,
        probe: &'a File,
    ) -> Self {
        Self {
            region,
            ext,
            host,
            probe,
        }
    }

    pub(super) fn proc_of(&self, slot: usize) -> Option<&HamiProcSlot> {
        let index = self.ext.slots.get(slot)?.hami_index.load(Ordering::Relaxed) as usize;
        self.region.procs.get(index)
    }

    /// Write HAMi slot `index` entirely from slot record `slot`.
    pub(super) fn write_proc(&self, index: usize, slot: usize, hostpid: i32) {
        let (Some(p), Some(rec)) = (self.region.procs.get(index), self.ext.slots.get(slot)) else {
            return;
        };
        p.pid
            .store(rec.pid.load(Ordering::Relaxed), Ordering::Relaxed);
        p.hostpid.store(hostpid, Ordering::Relaxed);
        for device in 0..MAX_DEVICES {
            write_used(p, rec, device);
            p.device_util[device].sm_util.store(
                rec.sm_util[device].load(Ordering::Relaxed),
                Ordering::Relaxed,
            );
        }
        p.seqlock.store(0, Ordering::Relaxed);
        p.status.store(HAMI_STATUS_RUNNING, Ordering::Release);
        rec.hami_index.store(index as u32, Ordering::Relaxed);
    }

    pub(super) fn clear_proc(&self, index: usize) {
        let Some(p) = self.region.procs.get(index) else {
            return;
        };
        p.pid.store(0, Ordering::Relaxed);
        p.hostpid.store(0, Ordering::Relaxed);
        p.status.store(0, Ordering::Relaxed);
        p.seqlock.store(0, Ordering::Relaxed);
        for device in 0..MAX_DEVICES {
            let u = &p.used[device];
            for f in [
                &u.context_size,
                &u.module_size,
                &u.data_size,
                &u.offset,
                &u.total,
            ] {
                f.store(0, Ordering::Relaxed);
            }
            p.device_util[device].sm_util.store(0, Ordering::Relaxed);
        }
    }
}

fn write_used(p: &HamiProcSlot, rec: &SlotRecord, device: usize) {
    let h = &rec.held[device];
    let (c, m, d) = (
        h[0].load(Ordering::Relaxed),
        h[1].load(Ordering::Relaxed),
        h[2].load(Ordering::Relaxed),
    );
    let u = &p.used[device];
    u.context_size.store(c, Ordering::Relaxed);
    u.module_size.store(m, Ordering::Relaxed);
    u.data_size.store(d, Ordering::Relaxed);
    u.offset.store(0, Ordering::Relaxed);
    u.total
        .store(c.saturating_add(m).saturating_add(d), Ordering::Relaxed);
}

impl Store for Mapped<'_> {
    type A = std::sync::atomic::AtomicU64;
    fn device_count(&self) -> usize {
        MAX_DEVICES
    }
    fn slot_count(&self) -> usize {
        MAX_SLOTS
    }
    fn lock_word(&self, device: usize) -> &Self::A {
        &self.ext.devices[device].lock
    }
    fn total(&self, device: usize) -> &Self::A {
        &self.ext.devices[device].total
    }
    fn limit(&self, device: usize) -> u64 {
        self.region.limit[device].load(Ordering::Relaxed)
    }
    fn held(&self, slot: usize, device: usize, class: usize) -> &Self::A {
        if class < CLASSES {
            &self.ext.slots[slot].held[device][class]
        } else {
            self.host.map_or(&NO_HOST_BYTES, |h| &h.slots[slot][device])
        }
    }
    fn host_total(&self, device: usize) -> &Self::A {
        if self.host.is_some() {
            &self.ext.devices[device].host_total
        } else {
            &NO_HOST_BYTES
        }
    }
    fn host_policy(&self, device: usize) -> HostPolicy {
        if self.host.is_none() {
            return HostPolicy::default();
        }
        HostPolicy {
            spill: self.host_spill(device),
            oversubscribe: self.oversubscribed(device),
        }
    }
    fn host_spill(&self, device: usize) -> u64 {
        self.ext.devices[device].host_spill.load(Ordering::Relaxed)
    }
    fn oversubscribed(&self, device: usize) -> bool {
        // The flag shares the device lock's cache line; a file without the host class has
        // none set (a read-only view of an older file: never reserved through).
        self.ext.devices[device].host_flags.load(Ordering::Relaxed) & HOST_FLAG_OVERSUBSCRIBE != 0
    }
    fn ident(&self, slot: usize) -> &Self::A {
        &self.ext.slots[slot].ident
    }
    fn admin_epoch(&self) -> u64 {
        self.ext.header.admin_epoch.load(Ordering::Acquire)
    }
    fn probe_slot_alive(&self, slot: usize) -> bool {
        sys::ofd_is_locked(self.probe, SLOT_LOCK_BASE + slot as u64)
    }
    fn probe_admin_alive(&self) -> bool {
        sys::ofd_is_locked(self.probe, ADMIN_LOCK_OFFSET)
    }
    fn mirror(&self, slot: usize, device: usize) {
        if let (Some(p), Some(rec)) = (self.proc_of(slot), self.ext.slots.get(slot)) {
            write_used(p, rec, device);
        }
    }
    fn rebuild_view(&self) {
        let old_n = self
            .region
            .proc_num
            .load(Ordering::Relaxed)
            .clamp(0, MAX_SLOTS as i32) as usize;
        // Live slots in their current HAMi order (stable for the monitor), with the hostpid the
        // monitor may have written into their current HAMi slot.
        let mut live: Vec<(u32, usize, i32)> = (0..MAX_SLOTS)
            .filter(|&j| {
                split_ident(self.ext.slots[j].ident.load(Ordering::Acquire)).1 == STATE_LIVE
            })
            .map(|j| {
                let rec = &self.ext.slots[j];
                let index = rec.hami_index.load(Ordering::Relaxed);
                let mut hostpid = rec.hostpid.load(Ordering::Relaxed);
                if let Some(p) = self.region.procs.get(index as usize)
                    && (index as usize) < old_n
                    && p.pid.load(Ordering::Relaxed) == rec.pid.load(Ordering::Relaxed)
                {
                    let written = p.hostpid.load(Ordering::Relaxed);
                    if written != 0 {
                        hostpid = written;
                        rec.hostpid.store(written, Ordering::Relaxed);
                    }
                }
                (index, j, hostpid)
            })
            .collect();
        live.sort_unstable();
        for (k, &(_, j, hostpid)) in live.iter().enumerate() {
            self.write_proc(k, j, hostpid);
        }
        for k in live.len()..MAX_SLOTS {
            if k < old_n || self.region.procs[k].pid.load(Ordering::Relaxed) != 0 {
                self.clear_proc(k);
            }
        }
        self.region
            .proc_num
            .store(live.len() as i32, Ordering::Release);
    }
}
