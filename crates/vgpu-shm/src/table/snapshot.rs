//! [`TableSnapshot`]: a lock-free, read-only picture of a table for `vgpu status`, `watch`
//! and the exporter.

use std::sync::atomic::Ordering;

use vgpu_alloc_core::DeviceIndex;

use crate::layout::{HAMI_STATUS_SUSPENDED, SlotRecord};
use crate::protocol::{HOST, HostPolicy, STATE_LIVE, Store, split_ident};

use super::fields::read;
use super::{Mapped, SWEEP_LOCK_TIMEOUT, UsageTable};
use crate::layout::PublishTimes;

/// Per-device state in a [`TableSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSnapshot {
    /// Device index.
    pub index: u32,
    /// NVML UUID.
    pub uuid: String,
    /// Memory limit (`None` = unlimited).
    pub limit: Option<u64>,
    /// SM limit in percent (`None` = unlimited).
    pub sm_limit: Option<u64>,
    /// Bytes reserved by all processes.
    pub used: u64,
    /// Context bytes of all processes.
    pub context: u64,
    /// Module bytes of all processes.
    pub module: u64,
    /// Data bytes of all processes.
    pub data: u64,
    /// Host-backed bytes of all processes at this device's addresses (not in `used`, which is
    /// device-resident memory; docs/oversubscription.md).
    pub host: u64,
    /// The device's host policy: host-backed bytes allowed beyond the limit
    /// (`VGPU_HOST_SPILL`) and whether oversubscription (`CUDA_OVERSUBSCRIBE`) is on.
    pub host_policy: HostPolicy,
    /// Reservations on this device the limit refused since the file was created (or
    /// upgraded to count them), by every process; 0 in a file of an older library.
    pub oom_refusals: u64,
}

/// One process's usage of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcessDeviceUsage {
    /// Context bytes.
    pub context: u64,
    /// Module bytes.
    pub module: u64,
    /// Data bytes.
    pub data: u64,
    /// Host-backed bytes at this device's addresses (not in [`ProcessDeviceUsage::total`]).
    pub host: u64,
    /// Last reported SM utilization, percent.
    pub sm_util: u64,
    /// When `sm_util` was reported: `CLOCK_MONOTONIC` nanoseconds (one clock for every
    /// process of the host). `None` when unknown: reported without a time, by a library that
    /// writes none, or the file has no time table.
    pub sm_util_at: Option<u64>,
}

impl ProcessDeviceUsage {
    /// All device-resident bytes (context, module, data; host-backed ones are `host`).
    pub fn total(&self) -> u64 {
        self.context
            .saturating_add(self.module)
            .saturating_add(self.data)
    }
}

/// One registered process in a [`TableSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSnapshot {
    /// vgpu slot index (stable while the process lives).
    pub slot: usize,
    /// Position in HAMi's `procs[]`.
    pub hami_index: u32,
    /// Pid in the registering process's namespace.
    pub pid: i32,
    /// Host pid (written by the monitor or the process), 0 if unknown.
    pub hostpid: i32,
    /// Start time in clock ticks after boot.
    pub start_time: u64,
    /// Whether the process holds its liveness lock (false: dead, awaiting a sweep); in a
    /// HAMi-core file, whether its slot `status` says running or suspended.
    pub alive: bool,
    /// Whether HAMi's slot `status` says suspended (only HAMi-core's own library writes that).
    pub suspended: bool,
    /// Whether the process has its memory swapped out now (docs/swap.md; false in a file of
    /// an older library, or a HAMi-core file).
    pub swapped_out: bool,
    /// Bytes of pinned host memory it keeps for its swap-outs, holding none of its data now
    /// (docs/swap.md "Host memory"; its swapped-out data is `host` meanwhile). 0 for a dead
    /// process (the memory went with it). `None` when it does not say: a file of an older
    /// library, a process of one, or a HAMi-core file. Whoever can write the file can write
    /// it: for display only.
    pub kept_host: Option<u64>,
    /// Usage per device, `device_num` entries.
    pub devices: Vec<ProcessDeviceUsage>,
}

/// A read-only, lock-free picture of the table (each number exact, the whole not atomic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSnapshot {
    /// The devices (`device_num` of them).
    pub devices: Vec<DeviceSnapshot>,
    /// Registered processes.
    pub processes: Vec<ProcessSnapshot>,
    /// HAMi's `proc_num`.
    pub proc_num: i32,
    /// `priority`.
    pub priority: i32,
    /// `recent_kernel` (monitor).
    pub recent_kernel: i32,
    /// `utilization_switch` (monitor).
    pub utilization_switch: i32,
    /// `last_kernel_time`, seconds since the epoch.
    pub last_kernel_time: u64,
    /// The processes' [`ProcessSnapshot::kept_host`] added up (saturating: a tenant's words
    /// cannot wrap it); `None` in a file of an older library or a HAMi-core file.
    pub kept_host: Option<u64>,
}

impl UsageTable {
    /// A picture of the table for `vgpu status` and exporters. Never waits on a dead writer:
    /// it reads without locks; a writable handle first tries (briefly) to sweep dead processes.
    pub fn snapshot(&self) -> TableSnapshot {
        if self.check_writable().is_ok() {
            let _ = self.sweep_with_timeout(SWEEP_LOCK_TIMEOUT);
        }
        picture(&self.store(), self.times())
    }
}

/// The picture of a table, from the mapping or from a node-side reader's private copy (the
/// same decoding either way); `times` when the file has the publish-time table.
pub(crate) fn picture(st: &Mapped<'_>, times: Option<&PublishTimes>) -> TableSnapshot {
    let r = st.region;
    let device_num = read::device_num(r) as usize;
    let minor = st.ext.header.minor_version.load(Ordering::Acquire);
    // The count is there from minor version 3 on; before, the word is padding.
    let counts_refusals = minor >= 3;
    // The swapped-out word from minor version 4 on.
    let says_swapped = minor >= 4;
    // So are the kept host bytes from minor version 5 on.
    let says_kept = minor >= 5;
    let mut devices: Vec<DeviceSnapshot> = (0..device_num)
        .map(|d| DeviceSnapshot {
            index: d as u32,
            uuid: read::uuid(r, DeviceIndex(d as u32)),
            limit: read::memory_limit(r, DeviceIndex(d as u32)),
            sm_limit: read::sm_limit(r, DeviceIndex(d as u32)),
            used: st.ext.devices[d].total.load(Ordering::Relaxed),
            context: 0,
            module: 0,
            data: 0,
            host: st.host_total(d).load(Ordering::Relaxed),
            host_policy: st.host_policy(d),
            oom_refusals: if counts_refusals {
                st.ext.devices[d].oom_refusals.load(Ordering::Relaxed)
            } else {
                0
            },
        })
        .collect();
    let mut processes = Vec::new();
    for (j, rec) in st.ext.slots.iter().enumerate() {
        let ident = rec.ident.load(Ordering::Acquire);
        let (_, state) = split_ident(ident);
        // Times count only if the slot's current process wrote them.
        let own_times = times
            .map(|t| &t.slots[j])
            .filter(|t| t.ident.load(Ordering::Acquire) == ident);
        let usage = |d: usize| ProcessDeviceUsage {
            context: rec.held[d][0].load(Ordering::Relaxed),
            module: rec.held[d][1].load(Ordering::Relaxed),
            data: rec.held[d][2].load(Ordering::Relaxed),
            host: st.held(j, d, HOST).load(Ordering::Relaxed),
            sm_util: rec.sm_util[d].load(Ordering::Relaxed),
            sm_util_at: own_times
                .map(|t| t.sm_util_at[d].load(Ordering::Relaxed))
                .filter(|&at| at != 0),
        };
        for (d, dev) in devices.iter_mut().enumerate() {
            let u = usage(d);
            dev.context = dev.context.saturating_add(u.context);
            dev.module = dev.module.saturating_add(u.module);
            dev.data = dev.data.saturating_add(u.data);
        }
        if state != STATE_LIVE {
            continue;
        }
        let hami_index = rec.hami_index.load(Ordering::Relaxed);
        let pid = rec.pid.load(Ordering::Relaxed);
        let mirror = r
            .procs
            .get(hami_index as usize)
            .filter(|p| p.pid.load(Ordering::Relaxed) == pid);
        let hostpid = mirror
            .map(|p| p.hostpid.load(Ordering::Relaxed))
            .filter(|&h| h != 0)
            .unwrap_or_else(|| rec.hostpid.load(Ordering::Relaxed));
        let suspended =
            mirror.is_some_and(|p| p.status.load(Ordering::Relaxed) == HAMI_STATUS_SUSPENDED);
        let alive = st.probe_slot_alive(j);
        processes.push(ProcessSnapshot {
            slot: j,
            hami_index,
            pid,
            hostpid,
            start_time: rec.start_time.load(Ordering::Relaxed),
            alive,
            suspended,
            swapped_out: says_swapped && rec.swapped_out.load(Ordering::Relaxed) != 0,
            kept_host: kept_host(rec, ident, alive).filter(|_| says_kept),
            devices: (0..device_num).map(usage).collect(),
        });
    }
    processes.sort_by_key(|p| p.hami_index);
    let kept_total = says_kept.then(|| {
        processes
            .iter()
            .filter_map(|p| p.kept_host)
            .fold(0, u64::saturating_add)
    });
    TableSnapshot {
        devices,
        processes,
        proc_num: r.proc_num.load(Ordering::Relaxed),
        priority: r.priority.load(Ordering::Relaxed),
        recent_kernel: r.recent_kernel.load(Ordering::Relaxed),
        utilization_switch: r.utilization_switch.load(Ordering::Relaxed),
        last_kernel_time: r.last_kernel_time.load(Ordering::Relaxed),
        kept_host: kept_total,
    }
}

/// Slot `rec`'s kept host bytes, if the process holding it (`ident`) wrote them: 0 once it
/// is dead, since pinned memory goes with its process.
fn kept_host(rec: &SlotRecord, ident: u64, alive: bool) -> Option<u64> {
    let own = rec.kept_ident.load(Ordering::Relaxed) == ident;
    own.then(|| {
        if alive {
            rec.kept_host.load(Ordering::Relaxed)
        } else {
            0
        }
    })
}
