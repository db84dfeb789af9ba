//! The file's limits and the monitor's fields (HAMi's region), read and written with single
//! atomic operations.

use std::sync::atomic::Ordering;

use vgpu_alloc_core::{DeviceIndex, DeviceUsage};

use crate::error::ShmError;
use crate::layout::{self, HOST_FLAG_OVERSUBSCRIBE, MAX_DEVICES};
use crate::protocol::{HostPolicy, Store};

use super::{RECENT_KERNEL_ACTIVE, UsageTable, now_secs};

/// The region's fields as the getters below and the snapshot (of a mapping or a copy) read
/// them: clamped, unset = empty or unlimited.
pub(super) mod read {
    use super::*;
    use crate::layout::HamiRegion;

    pub(crate) fn device_num(r: &HamiRegion) -> u32 {
        r.device_num.load(Ordering::Relaxed).min(MAX_DEVICES as u64) as u32
    }

    pub(crate) fn uuid(r: &HamiRegion, device: DeviceIndex) -> String {
        r.uuids
            .get(device.as_usize())
            .map(|u| layout::uuid_of(u.iter().map(|b| b.load(Ordering::Relaxed))))
            .unwrap_or_default()
    }

    pub(crate) fn memory_limit(r: &HamiRegion, device: DeviceIndex) -> Option<u64> {
        let v = r.limit.get(device.as_usize())?;
        layout::memory_limit_of(v.load(Ordering::Relaxed))
    }

    pub(crate) fn sm_limit(r: &HamiRegion, device: DeviceIndex) -> Option<u64> {
        let v = r.sm_limit.get(device.as_usize())?;
        layout::sm_limit_of(v.load(Ordering::Relaxed))
    }
}

/// `device`'s entry of a per-device array of the file, or the error a setter gives for a
/// device out of range.
fn per_device<T>(entries: &[T; MAX_DEVICES], device: DeviceIndex) -> Result<&T, ShmError> {
    entries
        .get(device.as_usize())
        .ok_or(ShmError::InvalidDevice {
            device: device.0,
            max: MAX_DEVICES,
        })
}

impl UsageTable {
    /// Number of devices in the file.
    pub fn device_num(&self) -> u32 {
        read::device_num(self.region())
    }

    /// NVML UUID of `device` (empty if unset).
    pub fn uuid(&self, device: DeviceIndex) -> String {
        read::uuid(self.region(), device)
    }

    /// Memory limit of `device` as stored now (`None` = unlimited).
    pub fn memory_limit(&self, device: DeviceIndex) -> Option<u64> {
        read::memory_limit(self.region(), device)
    }

    /// SM limit of `device` in percent (`None` = unlimited: 0 or >= 100).
    pub fn sm_limit(&self, device: DeviceIndex) -> Option<u64> {
        read::sm_limit(self.region(), device)
    }

    /// Change the memory limit of `device` on the live file; enforced from the next
    /// reservation on. `None` = unlimited. Usage already above a lowered limit stays until freed.
    pub fn set_memory_limit(
        &self,
        device: DeviceIndex,
        limit: Option<u64>,
    ) -> Result<(), ShmError> {
        self.check_writable()?;
        let slot = per_device(&self.region().limit, device)?;
        if limit == Some(0) {
            return Err(ShmError::InvalidValue {
                what: "memory limit",
                value: "0 (use None for unlimited)".into(),
            });
        }
        slot.store(limit.unwrap_or(0), Ordering::Release);
        Ok(())
    }

    /// Set `device`'s host policy on the live file (single atomic stores, like the limits):
    /// how much host-backed memory its processes may hold beyond the limit, and whether
    /// oversubscription lets host memory stand in for device memory within it. Enforced from
    /// the next reservation on; host bytes already held stay until freed.
    pub fn set_host_policy(&self, device: DeviceIndex, policy: HostPolicy) -> Result<(), ShmError> {
        self.check_writable()?;
        let d = per_device(&self.ext().devices, device)?;
        store_host_policy(d, policy, Ordering::Release);
        Ok(())
    }

    /// Host-backed bytes all processes hold at `device`'s addresses now (one load; 0 for a
    /// file without the host class).
    pub fn host_used(&self, device: DeviceIndex) -> u64 {
        if device.as_usize() >= MAX_DEVICES {
            return 0;
        }
        self.store()
            .host_total(device.as_usize())
            .load(Ordering::Relaxed)
    }

    /// Count one reservation on `device` that the limit refused (the caller answered out of
    /// memory). One relaxed add: a count for people watching, ordered with nothing. A file
    /// written by an older library gets its count at its in-place upgrade; a read-only view
    /// of one has none, and counts nothing.
    pub fn count_refusal(&self, device: DeviceIndex) {
        let Some(d) = self.ext().devices.get(device.as_usize()) else {
            return;
        };
        if self.ext().header.minor_version.load(Ordering::Relaxed) >= 3 {
            d.oom_refusals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Asks every process of this file that swaps (docs/swap.md) to swap out: one relaxed add
    /// to the file's count of requests. The count it held before; `None` for a read-only table
    /// or a file of an older library (which has no count: it is upgraded when opened for
    /// writing).
    pub fn request_swap_out(&self) -> Option<u32> {
        self.check_writable().ok()?;
        let h = &self.ext().header;
        (h.minor_version.load(Ordering::Acquire) >= 4)
            .then(|| h.swap_requests.fetch_add(1, Ordering::Relaxed))
    }

    /// The file's count of swap-out requests (0 in a file of an older library).
    pub fn swap_requests(&self) -> u32 {
        let h = &self.ext().header;
        if h.minor_version.load(Ordering::Acquire) >= 4 {
            h.swap_requests.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// `device`'s host policy as stored now.
    pub fn host_policy(&self, device: DeviceIndex) -> HostPolicy {
        if device.as_usize() >= MAX_DEVICES {
            return HostPolicy::default();
        }
        self.store().host_policy(device.as_usize())
    }

    /// Change the SM limit (percent, 1..=100; `None` = unlimited) of `device` on the live file.
    pub fn set_sm_limit(&self, device: DeviceIndex, percent: Option<u64>) -> Result<(), ShmError> {
        self.check_writable()?;
        let slot = per_device(&self.region().sm_limit, device)?;
        if let Some(p) = percent
            && !(1..=100).contains(&p)
        {
            return Err(ShmError::InvalidValue {
                what: "SM limit percent",
                value: p.to_string(),
            });
        }
        slot.store(percent.unwrap_or(0), Ordering::Release);
        Ok(())
    }

    /// `recent_kernel` as the monitor last wrote it (negative: hold back launches).
    pub fn recent_kernel(&self) -> i32 {
        self.region().recent_kernel.load(Ordering::Relaxed)
    }

    /// `utilization_switch` as the monitor last wrote it.
    pub fn utilization_switch(&self) -> i32 {
        self.region().utilization_switch.load(Ordering::Relaxed)
    }

    /// `priority`.
    pub fn priority(&self) -> i32 {
        self.region().priority.load(Ordering::Relaxed)
    }

    /// Change `priority` (`CUDA_TASK_PRIORITY`; lower is more urgent) on the live file: the
    /// SM limiter of a share-mode container reads it on every admission (docs/sm-limit.md).
    pub fn set_priority(&self, priority: i32) -> Result<(), ShmError> {
        self.check_writable()?;
        self.region().priority.store(priority, Ordering::Relaxed);
        Ok(())
    }

    /// `last_kernel_time`: seconds since the epoch of the last recorded kernel launch.
    pub fn last_kernel_time(&self) -> u64 {
        self.region().last_kernel_time.load(Ordering::Relaxed)
    }

    /// Record a kernel launch now in `last_kernel_time` (written only when the second changes,
    /// so launches do not bounce the cache line).
    pub fn touch_kernel_time(&self) {
        if self.check_writable().is_err() {
            return;
        }
        let now = now_secs();
        let t = &self.region().last_kernel_time;
        if t.load(Ordering::Relaxed) != now {
            t.store(now, Ordering::Relaxed);
        }
    }

    /// Tell the monitor that this container launches kernels, as HAMi-core does on launches:
    /// `recent_kernel = 2` (the monitor decrements it on each pass and counts the task as
    /// active while it is positive) and `last_kernel_time` = now. A negative `recent_kernel`
    /// is the monitor's "block launches" signal and is never overwritten: the store is a
    /// compare-and-swap from a non-negative value, so a monitor write that lands in between
    /// wins. Nothing is written when the value is already 2 (no cache-line bouncing). Meant
    /// to be called at most about once a second (the hook calls it from the SM limiter).
    pub fn note_kernel_activity(&self) {
        if self.check_writable().is_err() {
            return;
        }
        let recent = &self.region().recent_kernel;
        let mut current = recent.load(Ordering::Relaxed);
        while current >= 0 && current != RECENT_KERNEL_ACTIVE {
            match recent.compare_exchange_weak(
                current,
                RECENT_KERNEL_ACTIVE,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(seen) => current = seen,
            }
        }
        self.touch_kernel_time();
    }

    /// Usage of `device` by everyone (the authoritative per-device total).
    pub fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        let d = device.as_usize();
        DeviceUsage {
            used: self
                .ext()
                .devices
                .get(d)
                .map_or(0, |r| r.total.load(Ordering::Relaxed)),
            limit: self.memory_limit(device),
        }
    }
}

/// Writes `policy` into a device's words of the extension (one store each).
pub(super) fn store_host_policy(d: &layout::DeviceRecord, policy: HostPolicy, order: Ordering) {
    d.host_spill.store(policy.spill, order);
    let flags = if policy.oversubscribe {
        HOST_FLAG_OVERSUBSCRIBE
    } else {
        0
    };
    d.host_flags.store(flags, order);
}
