//! [`ProcessSlot`]: this process's registration, the [`UsageLedger`] the hook reserves
//! through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use vgpu_alloc_core::{DeviceIndex, DeviceUsage, OutOfMemory, UsageClass, UsageLedger};

use crate::error::ShmError;
use crate::layout::{CLASSES, MAX_DEVICES, MAX_SLOTS, SlotRecord};
use crate::protocol::{self, Charge, NoCrash, STATE_LIVE, Store, split_ident};
use crate::sys;

use super::{
    LEAVE_TIMEOUT, Mapped, ProcessDeviceUsage, SLOT_LOCK_BASE, SWEEP_LOCK_TIMEOUT, UsageTable,
    class_index,
};

/// One device's numbers read together under its lock (see [`ProcessSlot::audit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAudit {
    /// The device's reservation total.
    pub total: u64,
    /// The device's host-backed total.
    pub host_total: u64,
    /// Sum of every slot's host-backed bytes (equals `host_total`).
    pub host_held: u64,
    /// Sum of every slot's held bytes (equals `total` by the protocol's invariant).
    pub held: u64,
    /// Sum of HAMi's `used[device].total` over `[0, proc_num)` (what the monitor adds up).
    pub hami_used: u64,
}

impl DeviceAudit {
    /// Whether the three agree.
    pub fn is_consistent(&self) -> bool {
        self.total == self.held && self.held == self.hami_used && self.host_total == self.host_held
    }
}

/// This process's registration in a table: the [`UsageLedger`] the hook reserves through.
///
/// [`ProcessSlot::leave`] (at a normal exit) or dropping it deregisters (returns its usage to
/// the pool); so does process death, through the kernel-held liveness lock.
#[derive(Debug)]
pub struct ProcessSlot {
    pub(super) table: UsageTable,
    pub(super) index: usize,
    /// The owner word this process writes into device locks; 0 once it left the table.
    pub(super) owner: AtomicU64,
    pub(super) fork_epoch: u64,
}

impl ProcessSlot {
    /// The table.
    pub fn table(&self) -> &UsageTable {
        &self.table
    }

    /// This process's vgpu slot index.
    pub fn index(&self) -> usize {
        self.index
    }

    fn usable(&self) -> bool {
        sys::fork_epoch() == self.fork_epoch
    }

    /// The owner word, or `None` when the handle cannot act for the slot (forked, or left).
    fn owner(&self) -> Option<u64> {
        let owner = self.owner.load(Ordering::Relaxed);
        (owner != 0 && self.usable()).then_some(owner)
    }

    /// The owner word (tests that plant it in a lock).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn owner_word(&self) -> u64 {
        self.owner.load(Ordering::Relaxed)
    }

    /// Whether this process has left the table ([`ProcessSlot::leave`]): it then holds nothing,
    /// every reservation is refused and releases change nothing.
    pub fn has_left(&self) -> bool {
        self.owner.load(Ordering::Relaxed) == 0
    }

    fn with_device_locked<R>(&self, device: usize, f: impl FnOnce(&Mapped<'_>) -> R) -> Option<R> {
        let owner = self.owner()?;
        if device >= MAX_DEVICES {
            return None;
        }
        let st = self.table.store();
        let _ = protocol::lock_device(&st, device, owner, &NoCrash);
        // Still ours? The process may have left the table while this thread waited.
        let (generation, state) = split_ident(self.record().ident.load(Ordering::Relaxed));
        if state != STATE_LIVE || protocol::slot_owner_word(self.index, generation) != owner {
            let _ = st.ext.devices[device].lock.compare_exchange(
                owner,
                0,
                Ordering::Release,
                Ordering::Relaxed,
            );
            return None;
        }
        let r = f(&st);
        protocol::unlock_device(&st, device);
        Some(r)
    }

    fn record(&self) -> &SlotRecord {
        &self.table.ext().slots[self.index]
    }

    /// Report this process's SM utilization of `device` (percent) for the monitor, without a
    /// time (peers then take it as current until it changes; see [`ProcessSlot::publish_sm_util`]).
    pub fn set_sm_util(&self, device: DeviceIndex, percent: u64) {
        self.publish(device, percent, 0);
    }

    /// Report this process's SM utilization of `device` (percent) for the monitor and the
    /// peers, published at `at_ns` (`CLOCK_MONOTONIC` nanoseconds, the clock every process of
    /// the host shares), so that peers can ignore it once it is old: a process publishes only
    /// while it launches.
    ///
    /// Called periodically off the hot path (the SM limiter's publish step), it also sweeps dead
    /// processes at most once a second, so the monitor's numbers do not wait for the next refusal.
    pub fn publish_sm_util(&self, device: DeviceIndex, percent: u64, at_ns: u64) {
        self.publish(device, percent, at_ns);
    }

    fn publish(&self, device: DeviceIndex, percent: u64, at_ns: u64) {
        self.with_device_locked(device.as_usize(), |st| {
            let d = device.as_usize();
            let rec = self.record();
            rec.sm_util[d].store(percent, Ordering::Relaxed);
            if let Some(p) = st.proc_of(self.index) {
                p.device_util[d].sm_util.store(percent, Ordering::Relaxed);
            }
            if let Some(times) = self.table.times() {
                let t = &times.slots[self.index];
                t.sm_util_at[d].store(at_ns, Ordering::Relaxed);
                t.ident
                    .store(rec.ident.load(Ordering::Relaxed), Ordering::Release);
            }
        });
        self.table.periodic_sweep();
    }

    /// Record this process's host pid (if the hook knows it; the monitor may also write it).
    pub fn set_hostpid(&self, hostpid: i32) {
        self.with_device_locked(0, |st| {
            self.record().hostpid.store(hostpid, Ordering::Relaxed);
            if let Some(p) = st.proc_of(self.index) {
                p.hostpid.store(hostpid, Ordering::Relaxed);
            }
        });
    }

    /// This process's host pid as the monitor wrote it into its HAMi slot (or
    /// [`set_hostpid`](Self::set_hostpid) recorded), `None` if nobody did. NVML lists processes
    /// by host pid, which differs from `getpid()` in a container with its own PID namespace.
    pub fn hostpid(&self) -> Option<i32> {
        let rec = self.record();
        let st = self.table.store();
        let pid = rec.pid.load(Ordering::Relaxed);
        let written = st
            .proc_of(self.index)
            .filter(|p| p.pid.load(Ordering::Relaxed) == pid)
            .map(|p| p.hostpid.load(Ordering::Relaxed))
            .filter(|&h| h > 0);
        written.or_else(|| Some(rec.hostpid.load(Ordering::Relaxed)).filter(|&h| h > 0))
    }

    /// Record a kernel launch now (see [`UsageTable::touch_kernel_time`]).
    pub fn touch_kernel_time(&self) {
        self.table.touch_kernel_time();
    }

    /// Bytes this process holds on `device`.
    pub fn held(&self, device: DeviceIndex) -> ProcessDeviceUsage {
        let Some(h) = self.record().held.get(device.as_usize()) else {
            return ProcessDeviceUsage::default();
        };
        ProcessDeviceUsage {
            context: h[0].load(Ordering::Relaxed),
            module: h[1].load(Ordering::Relaxed),
            data: h[2].load(Ordering::Relaxed),
            host: self.held_host(device),
            sm_util: self.record().sm_util[device.as_usize()].load(Ordering::Relaxed),
            sm_util_at: self
                .table
                .times()
                .map(|t| &t.slots[self.index])
                .filter(|t| {
                    t.ident.load(Ordering::Acquire) == self.record().ident.load(Ordering::Acquire)
                })
                .map(|t| t.sm_util_at[device.as_usize()].load(Ordering::Relaxed))
                .filter(|&at| at != 0),
        }
    }

    /// Read `device`'s total, the sum of every slot's held bytes and the sum of HAMi's
    /// `used[].total` over `[0, proc_num)`, all under the device lock (so they must agree).
    /// O(slots); for tests and consistency checks. `None` for a bad device or a forked handle.
    pub fn audit(&self, device: DeviceIndex) -> Option<DeviceAudit> {
        let d = device.as_usize();
        self.with_device_locked(d, |st| {
            let total = st.ext.devices[d].total.load(Ordering::Relaxed);
            let held = (0..MAX_SLOTS)
                .flat_map(|j| (0..CLASSES).map(move |c| (j, c)))
                .map(|(j, c)| st.ext.slots[j].held[d][c].load(Ordering::Relaxed))
                .fold(0u64, u64::saturating_add);
            let host_total = st.host_total(d).load(Ordering::Relaxed);
            let host_held = (0..MAX_SLOTS)
                .map(|j| st.held(j, d, protocol::HOST).load(Ordering::Relaxed))
                .fold(0u64, u64::saturating_add);
            let n = st
                .region
                .proc_num
                .load(Ordering::Relaxed)
                .clamp(0, MAX_SLOTS as i32);
            let hami = st.region.procs[..n as usize]
                .iter()
                .map(|p| p.used[d].total.load(Ordering::Relaxed))
                .fold(0u64, u64::saturating_add);
            DeviceAudit {
                total,
                host_total,
                host_held,
                held,
                hami_used: hami,
            }
        })
    }

    /// Leave the table: give this process's usage back and free the slot.
    pub fn deregister(self) -> Result<(), ShmError> {
        self.leave()
    }

    /// Leave the table while other threads may still use this handle (the hook calls it when
    /// the process exits normally): give the usage back, free the slot and drop its liveness
    /// lock, at once, so that no sweep is needed. Afterwards every reservation through this
    /// handle is refused and every release changes nothing, also for a thread that was already
    /// waiting for a device lock (see `protocol::depart`). Waits at most one second for the
    /// locks it needs (it must not hang an exiting process); on [`ShmError::LeaveTimeout`] or
    /// [`ShmError::AdminLockTimeout`] the slot stays registered and usable, and the process's
    /// death gives it back. Idempotent; a no-op in a forked child.
    pub fn leave(&self) -> Result<(), ShmError> {
        if !self.usable() {
            return Ok(());
        }
        let owner = self.owner.swap(0, Ordering::AcqRel);
        if owner == 0 {
            return Ok(());
        }
        let index = self.index;
        let deadline = Instant::now() + LEAVE_TIMEOUT;
        let left = self.table.admin(LEAVE_TIMEOUT, |st, me| {
            let done = protocol::depart(st, me, index, &NoCrash, || Instant::now() >= deadline)
                .unwrap_or(false);
            if !done {
                return Err(ShmError::LeaveTimeout {
                    path: self.table.inner.path.clone(),
                });
            }
            // The slot is free: dropping its liveness lock now changes nobody's view.
            if let Some(f) = &self.table.inner.lock_file {
                sys::ofd_unlock(f, SLOT_LOCK_BASE + index as u64);
            }
            Ok(())
        });
        if left.is_err() {
            // Still registered and holding its usage: keep enforcing through it.
            self.owner.store(owner, Ordering::Release);
        }
        left
    }

    /// Test hook: behave as if this process died (drop the liveness lock, skip all cleanup).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn simulate_death(self) {
        if let Some(f) = &self.table.inner.lock_file {
            sys::ofd_unlock(f, SLOT_LOCK_BASE + self.index as u64);
        }
        self.owner.store(0, Ordering::Relaxed);
    }
}

impl ProcessSlot {
    /// This slot's charge of `bytes` of class `class` on `device`, unless the process left the
    /// table or the device is out of range.
    fn charge(&self, device: DeviceIndex, class: usize, bytes: u64) -> Option<Charge> {
        let d = device.as_usize();
        let me = self.owner().filter(|_| d < MAX_DEVICES)?;
        Some(Charge {
            slot: self.index,
            me,
            device: d,
            class,
            bytes,
        })
    }

    /// Runs `op` with the store and this slot's charge, unless [`Self::charge`] has none or
    /// there are no bytes to move (what the releases and `charge_over_limit` share; none can be
    /// refused).
    fn adjust(
        &self,
        device: DeviceIndex,
        class: usize,
        bytes: u64,
        op: impl FnOnce(&Mapped<'_>, Charge),
    ) {
        if let Some(charge) = self.charge(device, class, bytes).filter(|_| bytes != 0) {
            op(&self.table.store(), charge);
        }
    }
}

impl Drop for ProcessSlot {
    fn drop(&mut self) {
        let _ = self.leave();
    }
}

/// The host-backed class (docs/oversubscription.md): memory at a device's addresses that lives
/// in host memory. Kept apart from the device classes: it is not in the device's `total` (so
/// device-resident memory alone is bounded by the limit) nor in HAMi's fields (device memory
/// only); the device's [`HostPolicy`](crate::HostPolicy) bounds it.
impl ProcessSlot {
    /// Reserve `bytes` of host-backed memory at `device`'s addresses, within the device's host
    /// policy (refused when the policy allows none).
    pub fn try_reserve_host(&self, device: DeviceIndex, bytes: u64) -> Result<(), OutOfMemory> {
        self.reserve_class(device, protocol::HOST, bytes, protocol::Bound::Full)
    }

    /// Release up to `bytes` of this process's host-backed memory at `device`'s addresses.
    pub fn release_host(&self, device: DeviceIndex, bytes: u64) {
        self.release_class(device, protocol::HOST, bytes);
    }

    /// Reserve device room (class data) for `bytes` of this process's host-backed memory that
    /// is about to move onto `device`: only the device limit is checked, since those bytes
    /// already count against the combined bound. The move then ends with
    /// [`ProcessSlot::release_host`] (both are held meanwhile: a process killed in between
    /// gives both back), or, if it fails, with a release of the data bytes.
    pub fn try_reserve_move(&self, device: DeviceIndex, bytes: u64) -> Result<(), OutOfMemory> {
        self.reserve_class(
            device,
            class_index(UsageClass::Data),
            bytes,
            protocol::Bound::DeviceOnly,
        )
    }

    /// Charge `bytes` of this process's device memory that is about to be swapped out to
    /// host memory as host-backed bytes at `device`'s addresses, checking no bound: the bytes
    /// are already charged as data, which the swap-out releases after the copy (both are held
    /// meanwhile: a process killed in between gives both back), or, if it fails, with
    /// [`ProcessSlot::release_host`]. The swap moves bytes between classes; it never adds any.
    pub fn reserve_swap_out(&self, device: DeviceIndex, bytes: u64) -> Result<(), OutOfMemory> {
        self.reserve_class(device, protocol::HOST, bytes, protocol::Bound::Unchecked)
    }

    /// Says in the slot whether this process has its memory swapped out (for readers: `vgpu
    /// status`). Nothing decides on it.
    pub fn set_swapped_out(&self, swapped: bool) {
        if let Some(rec) = self.table.ext().slots.get(self.index) {
            rec.swapped_out.store(u32::from(swapped), Ordering::Relaxed);
        }
    }

    /// Says in the slot that this process keeps `bytes` more pinned host memory for its
    /// swap-outs, holding none of its data (docs/swap.md "Host memory"). For readers only
    /// (`vgpu status`, the exporter): nothing decides on it, so it takes no lock.
    pub fn add_kept_host(&self, bytes: u64) {
        self.update_kept_host(|kept| kept.saturating_add(bytes));
    }

    /// Says in the slot that this process keeps `bytes` less: given back, or filled by a
    /// swap-out (its bytes are then the host class).
    pub fn remove_kept_host(&self, bytes: u64) {
        self.update_kept_host(|kept| kept.saturating_sub(bytes));
    }

    /// The pinned host memory this process says it keeps for swap-outs.
    pub fn kept_host(&self) -> u64 {
        self.table
            .ext()
            .slots
            .get(self.index)
            .map_or(0, |rec| rec.kept_host.load(Ordering::Relaxed))
    }

    /// One atomic change of the slot's kept bytes (the process's threads may change it at
    /// once: a swap-in on one, a free on another). Saturating, so a word someone else
    /// overwrote never wraps into a huge figure.
    fn update_kept_host(&self, f: impl Fn(u64) -> u64) {
        if let Some(rec) = self.table.ext().slots.get(self.index) {
            let _ = rec
                .kept_host
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |kept| Some(f(kept)));
        }
    }

    /// Bytes of host-backed memory this process holds at `device`'s addresses.
    pub fn held_host(&self, device: DeviceIndex) -> u64 {
        self.table
            .host_held()
            .and_then(|h| h.slots[self.index].get(device.as_usize()))
            .map_or(0, |w| w.load(Ordering::Relaxed))
    }

    fn reserve_class(
        &self,
        device: DeviceIndex,
        c: usize,
        bytes: u64,
        bound: protocol::Bound,
    ) -> Result<(), OutOfMemory> {
        let refuse = |in_use, limit| OutOfMemory {
            device,
            requested: bytes,
            in_use,
            limit,
        };
        let Some(charge) = self.charge(device, c, bytes) else {
            let usage = self.table.usage(device);
            return Err(refuse(usage.used, usage.limit.unwrap_or(0)));
        };
        if bytes == 0 {
            return Ok(());
        }
        let mut swept = false;
        loop {
            let st = self.table.store();
            let done = match protocol::reserve_within(&st, charge, bound, &NoCrash) {
                Ok(done) => done,
                Err(protocol::Died) => return Err(refuse(0, 0)), // NoCrash never dies
            };
            match done.value {
                Ok(_) => {
                    if done.took_over {
                        // A dead owner was found: return its usage to the pool soon.
                        let _ = self.table.sweep_with_timeout(SWEEP_LOCK_TIMEOUT);
                    }
                    return Ok(());
                }
                Err(refusal) => {
                    // Before refusing, give back what dead processes hold, then try once more
                    // (unless this process left the table meanwhile: nothing would fit).
                    if !swept
                        && !self.has_left()
                        && matches!(self.table.sweep_with_timeout(SWEEP_LOCK_TIMEOUT), Ok(n) if n > 0)
                    {
                        swept = true;
                        continue;
                    }
                    return Err(refuse(refusal.in_use, refusal.limit));
                }
            }
        }
    }

    fn release_class(&self, device: DeviceIndex, class: usize, bytes: u64) {
        self.adjust(device, class, bytes, |st, charge| {
            let _ = protocol::release(st, charge, &NoCrash);
        });
    }
}

impl UsageLedger for ProcessSlot {
    #[inline]
    fn try_reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        self.reserve_class(device, class_index(class), bytes, protocol::Bound::Full)
    }

    #[inline]
    fn release(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        self.release_class(device, class_index(class), bytes);
    }

    fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        self.table.usage(device)
    }

    fn charge_over_limit(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        self.adjust(device, class_index(class), bytes, |st, charge| {
            let _ = protocol::reserve_within(st, charge, protocol::Bound::Unchecked, &NoCrash);
        });
    }
}
