//! The ABI of the shared file: the only module that knows byte offsets.
//!
//! The file is HAMi-core's version 1.2 region (2,008,952 bytes, every offset exact, so HAMi's
//! Kubernetes monitor keeps reading it), one spare byte (HAMi's files are `sizeof(region) + 1`
//! long), padding to a 64-byte boundary, then vgpu's [`Extension`]: our magic and version, the
//! per-device lock and reservation total, and one [`SlotRecord`] per process slot holding the
//! process's usage (the truth; HAMi's per-slot fields are a mirror of it).
//!
//! Every field is an atomic type: other processes write the file concurrently, so a shared
//! reference to these structs is only sound if all access goes through atomics.

use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI32, AtomicU8, AtomicU32, AtomicU64};

/// Devices in the file (HAMi's `CUDA_DEVICE_MAX_COUNT`).
pub const MAX_DEVICES: usize = 16;
/// Process slots in the file (HAMi's `SHARED_REGION_MAX_PROCESS_NUM`).
pub const MAX_SLOTS: usize = 1024;
/// Bytes of one NVML UUID string field.
pub const UUID_LEN: usize = 96;
/// HAMi's `initialized_flag` value of an initialized file.
pub const HAMI_MAGIC: i32 = 19_920_718;
/// HAMi layout version this file implements.
pub const HAMI_MAJOR: u32 = 1;
/// HAMi layout minor version this file implements.
pub const HAMI_MINOR: u32 = 2;
/// HAMi slot `status`: running.
pub const HAMI_STATUS_RUNNING: i32 = 1;

/// `sizeof(shared_region_t)` in HAMi-core 1.2.
pub const REGION_SIZE: usize = 2_008_952;
/// Length of a file written by HAMi-core itself (no extension).
pub const HAMI_FILE_LEN: usize = REGION_SIZE + 1;
/// Where [`Extension`] starts: after the region and HAMi's spare byte, 64-byte aligned.
pub const EXT_OFFSET: usize = HAMI_FILE_LEN.div_ceil(64) * 64;
/// Length of a vgpu file of extension minor version 0 (no [`PublishTimes`]): the shortest
/// file vgpu accepts, and what libraries before minor version 1 create.
pub const BASE_FILE_LEN: usize = EXT_OFFSET + size_of::<Extension>();
/// Where [`PublishTimes`] starts (minor version 1 and later).
pub const TIMES_OFFSET: usize = BASE_FILE_LEN;
/// Length of a vgpu file of minor version 1 (up to the [`PublishTimes`]).
pub const MINOR1_FILE_LEN: usize = TIMES_OFFSET + size_of::<PublishTimes>();
/// Where [`HostHeld`] starts (minor version 2 and later).
pub const HOST_OFFSET: usize = MINOR1_FILE_LEN;
/// Length of a vgpu file as this library creates it (minor version [`EXT_MINOR`]).
pub const FILE_LEN: usize = HOST_OFFSET + size_of::<HostHeld>();

/// The shortest length a file of extension minor version `minor` may have.
pub const fn len_of_minor(minor: u32) -> usize {
    match minor {
        0 => BASE_FILE_LEN,
        1 => MINOR1_FILE_LEN,
        _ => FILE_LEN,
    }
}

/// HAMi slot `status`: suspended.
pub const HAMI_STATUS_SUSPENDED: i32 = 2;

/// A `limit[d]` word as a limit: 0 means unlimited.
pub fn memory_limit_of(word: u64) -> Option<u64> {
    (word != 0).then_some(word)
}

/// An `sm_limit[d]` word as a limit: 0 or 100 and above mean unlimited.
pub fn sm_limit_of(word: u64) -> Option<u64> {
    (word != 0 && word < 100).then_some(word)
}

/// A NUL-padded `uuids[d]` field as a string (empty if unset).
pub fn uuid_of(field: impl IntoIterator<Item = u8>) -> String {
    let bytes: Vec<u8> = field.into_iter().take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Our extension's magic: ASCII "VGPUSHM\0" little endian.
pub const EXT_MAGIC: u64 = u64::from_le_bytes(*b"VGPUSHM\0");
/// Our extension's format version (bump on any incompatible change).
pub const EXT_VERSION: u32 = 1;
/// Our extension's minor version: bumped when a part is *appended* after the parts of the
/// previous minor version, which stay byte for byte the same (so libraries that know an older
/// minor keep working on the file; they check only [`EXT_VERSION`] and the base size). A reader
/// uses the parts it knows and that the file's minor version says are there.
/// - 0: header, devices, slots ([`Extension`]).
/// - 1: [`PublishTimes`] after the slots.
/// - 2: [`HostHeld`] after the publish times, and the host words of [`DeviceRecord`] (zero
///   padding before: an older file has host backing off and holds no host bytes).
/// - 3: [`DeviceRecord::oom_refusals`] (zero padding before: an older file counted none).
/// - 4: [`ExtHeader::swap_requests`] and [`SlotRecord::swapped_out`] (zero padding before:
///   nobody asked for a swap-out, and no process was swapped out).
/// - 5: [`SlotRecord::kept_ident`] and [`SlotRecord::kept_host`] (the record's trailing
///   padding before: no process said what host memory it keeps for swap-outs).
pub const EXT_MINOR: u32 = 5;

/// [`DeviceRecord::host_flags`] bit: host-backed bytes count against the device limit
/// (`CUDA_OVERSUBSCRIBE`): device-resident plus host-backed stays within limit + spill.
pub const HOST_FLAG_OVERSUBSCRIBE: u64 = 1;

/// Usage classes stored per slot and device, in HAMi field order.
pub const CLASSES: usize = 3;

/// HAMi `device_memory_t`: one device's usage by one process.
#[repr(C)]
#[derive(Debug)]
pub struct HamiDeviceMemory {
    /// `context_size`.
    pub context_size: AtomicU64,
    /// `module_size`.
    pub module_size: AtomicU64,
    /// `data_size`.
    pub data_size: AtomicU64,
    /// `offset` (unused by vgpu, kept 0).
    pub offset: AtomicU64,
    /// `total` = context + module + data + offset.
    pub total: AtomicU64,
    /// Unused.
    pub unused: [AtomicU64; 3],
}

/// HAMi `device_util_t`.
#[repr(C)]
#[derive(Debug)]
pub struct HamiDeviceUtil {
    /// `dec_util`.
    pub dec_util: AtomicU64,
    /// `enc_util`.
    pub enc_util: AtomicU64,
    /// `sm_util` (percent).
    pub sm_util: AtomicU64,
    /// Unused.
    pub unused: [AtomicU64; 3],
}

/// HAMi `shrreg_proc_slot_t`: one process as the monitor sees it.
#[repr(C)]
#[derive(Debug)]
pub struct HamiProcSlot {
    /// Pid in the container's namespace; 0 = free.
    pub pid: AtomicI32,
    /// Pid in the host namespace (the monitor may write it).
    pub hostpid: AtomicI32,
    /// Per-device memory usage.
    pub used: [HamiDeviceMemory; MAX_DEVICES],
    /// Memory as NVML sees it (not maintained by vgpu, kept 0).
    pub monitorused: [AtomicU64; MAX_DEVICES],
    /// Per-device utilization.
    pub device_util: [HamiDeviceUtil; MAX_DEVICES],
    /// 1 running, 2 suspended, 0 dead.
    pub status: AtomicI32,
    /// Padding the C compiler inserts before `seqlock`.
    pub pad0: AtomicU32,
    /// HAMi's per-slot sequence lock; vgpu keeps it even (stable) so no reader ever waits.
    pub seqlock: AtomicU64,
    /// Unused.
    pub unused: [AtomicU64; 2],
}

/// HAMi `shared_region_t` version 1.2.
#[repr(C)]
#[derive(Debug)]
pub struct HamiRegion {
    /// [`HAMI_MAGIC`] once initialized.
    pub initialized_flag: AtomicI32,
    /// [`HAMI_MAJOR`].
    pub major_version: AtomicU32,
    /// [`HAMI_MINOR`].
    pub minor_version: AtomicU32,
    /// HAMi-core's SM-watcher flag (kept 0).
    pub sm_init_flag: AtomicI32,
    /// Pid of the initializing process.
    pub owner_pid: AtomicU64,
    /// glibc `sem_t` (vgpu does not use it; initialized to a posted semaphore).
    pub sem: [AtomicU8; 32],
    /// Number of devices.
    pub device_num: AtomicU64,
    /// NVML UUID strings, NUL padded.
    pub uuids: [[AtomicU8; UUID_LEN]; MAX_DEVICES],
    /// Memory limit in bytes per device; 0 = unlimited. The monitor may rewrite it.
    pub limit: [AtomicU64; MAX_DEVICES],
    /// SM limit in percent per device; 0 or >= 100 = unlimited. The monitor may rewrite it.
    pub sm_limit: [AtomicU64; MAX_DEVICES],
    /// Process slots; `[0, proc_num)` are exactly the live processes.
    pub procs: [HamiProcSlot; MAX_SLOTS],
    /// Number of live slots.
    pub proc_num: AtomicI32,
    /// Written by the monitor.
    pub utilization_switch: AtomicI32,
    /// Written by the monitor; negative blocks launches of a lower-priority task.
    pub recent_kernel: AtomicI32,
    /// Task priority (`CUDA_TASK_PRIORITY`).
    pub priority: AtomicI32,
    /// Seconds since the epoch of the last kernel launch.
    pub last_kernel_time: AtomicU64,
    /// glibc `sem_t` (unused by vgpu).
    pub sem_postinit: [AtomicU8; 32],
}

/// vgpu's extension header.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct ExtHeader {
    /// [`EXT_MAGIC`] once initialized.
    pub magic: AtomicU64,
    /// [`EXT_VERSION`].
    pub version: AtomicU32,
    /// `size_of::<Extension>()`, a cheap check that the writer agreed on the layout.
    pub ext_size: AtomicU32,
    /// [`MAX_SLOTS`].
    pub max_slots: AtomicU32,
    /// [`MAX_DEVICES`].
    pub max_devices: AtomicU32,
    /// Nonzero while an administrative section (register, deregister, sweep) runs; found set
    /// by the next administrator it means the previous one died inside, and it repairs.
    pub admin_dirty: AtomicU64,
    /// Incremented by every administrative section; part of the device-lock owner word an
    /// administrator writes, so a dead administrator's locks are told apart from a live one's.
    pub admin_epoch: AtomicU64,
    /// Seconds since the epoch when the file was initialized.
    pub created_at: AtomicU64,
    /// [`EXT_MINOR`] of the parts present (0 in files written before minor versions existed,
    /// whose header had zero padding here).
    pub minor_version: AtomicU32,
    /// How many times `vgpu swap-out` asked the container's processes to swap out (minor
    /// version 4; wraps): a process that enables swapping remembers the count it found and
    /// swaps out when it changes (docs/swap.md). Only a count: nothing in it names a process
    /// or a size, so whoever can write the file can ask, and only its own container swaps.
    pub swap_requests: AtomicU32,
}

/// Per-device lock and reservation total.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct DeviceRecord {
    /// 0 = free, else the owner word (see `protocol`).
    pub lock: AtomicU64,
    /// Bytes reserved on the device by all slots: equals the sum of all slots' `held`
    /// whenever `lock` is free.
    pub total: AtomicU64,
    /// Host-backed bytes of all slots at this device's addresses (minor version 2): equals the
    /// sum of all slots' [`HostHeld`] whenever `lock` is free. Not part of `total`, which is
    /// device-resident memory only.
    pub host_total: AtomicU64,
    /// Host-backed bytes allowed beyond the device limit (`VGPU_HOST_SPILL`; 0 = none).
    pub host_spill: AtomicU64,
    /// [`HOST_FLAG_OVERSUBSCRIBE`] or 0.
    pub host_flags: AtomicU64,
    /// Reservations on this device the limit refused, by every process (minor version 3):
    /// a count only, for people watching; nothing decides on it. Wraps at `u64::MAX`.
    pub oom_refusals: AtomicU64,
    /// Padding to a cache line.
    pub pad: [AtomicU64; 2],
}

/// Per-process slot: vgpu's truth about one process.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct SlotRecord {
    /// `generation << 32 | state` (state 0 free, 1 live).
    pub ident: AtomicU64,
    /// Pid (the registering process's namespace).
    pub pid: AtomicI32,
    /// Host pid if known, else 0.
    pub hostpid: AtomicI32,
    /// Process start time, clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start_time: AtomicU64,
    /// This slot's index in HAMi's `procs[]` while live.
    pub hami_index: AtomicU32,
    /// Nonzero while the process has its memory swapped out (minor version 4; padding, zero,
    /// before): for readers only (`vgpu status`), its bytes are the host class meanwhile.
    /// Cleared when the slot is claimed.
    pub swapped_out: AtomicU32,
    /// Bytes held per device and class (context, module, data).
    pub held: [[AtomicU64; CLASSES]; MAX_DEVICES],
    /// Last SM utilization reported per device (percent), mirrored into HAMi's slot.
    pub sm_util: [AtomicU64; MAX_DEVICES],
    /// The slot's `ident` when its process zeroed [`SlotRecord::kept_host`] (minor version 5;
    /// padding, zero, before): the word is that process's figure only while this equals the
    /// slot's `ident`. A process of an older library never writes either word, so without
    /// this it would be shown the figure its slot's previous owner left.
    pub kept_ident: AtomicU64,
    /// Bytes of pinned host memory the process keeps for its swap-outs that hold none of its
    /// data now (minor version 5; docs/swap.md "Host memory"): memory a swap-in emptied and
    /// kept, or pinned ahead of an idle swap-out. Swapped-out data is not in it (it is the
    /// host class meanwhile), so the two add up to all the host memory swapping holds. For
    /// readers only (`vgpu status`, the exporter); nothing decides on it.
    pub kept_host: AtomicU64,
}

/// When a slot last published its `sm_util` (extension minor version 1).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct SlotPublish {
    /// The slot's `ident` when these times were written: the times belong to the process that
    /// holds the slot only while this equals the slot's current `ident` (a process of an
    /// older library, which writes no times, cannot be judged by its predecessor's).
    pub ident: AtomicU64,
    /// Per device: `CLOCK_MONOTONIC` nanoseconds of the last `sm_util` publication; 0 = never.
    /// One clock for every process of a host, containers included (a monotonic clock is not
    /// namespaced), so peers can compare it with their own.
    pub sm_util_at: [AtomicU64; MAX_DEVICES],
}

/// Publish times of every slot, after [`Extension`] (minor version 1).
#[repr(C)]
#[derive(Debug)]
pub struct PublishTimes {
    /// One per slot, indexed like [`Extension::slots`].
    pub slots: [SlotPublish; MAX_SLOTS],
}

/// Host-backed bytes per slot and device (extension minor version 2): the fourth usage class,
/// kept apart from `held` so that the slot records (and HAMi's mirror, device memory only)
/// keep their layout.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct HostHeld {
    /// Indexed like [`Extension::slots`], then by device.
    pub slots: [[AtomicU64; MAX_DEVICES]; MAX_SLOTS],
}

/// Everything vgpu keeps after HAMi's region.
#[repr(C)]
#[derive(Debug)]
pub struct Extension {
    /// Header.
    pub header: ExtHeader,
    /// One lock and total per device.
    pub devices: [DeviceRecord; MAX_DEVICES],
    /// One record per slot.
    pub slots: [SlotRecord; MAX_SLOTS],
}

/// Asserts at compile time that a `#[repr(C)]` type has HAMi's size and each named field sits
/// at HAMi's offset. Written as the C header's table (type, size, then field: offset), so a
/// struct's layout reads in one place and a wrong number names its type and field.
macro_rules! assert_layout {
    ($($ty:ident: $size:tt bytes { $($field:ident: $offset:expr),* $(,)? })*) => {$(
        assert!(size_of::<$ty>() == $size);
        $(assert!(offset_of!($ty, $field) == $offset);)*
    )*};
}

// Compile-time proof of every offset in docs hami-compat.md (x86_64 / 64-bit little endian).
const _: () = {
    assert_layout! {
        HamiRegion: REGION_SIZE bytes {
            initialized_flag: 0,
            major_version: 4,
            minor_version: 8,
            sm_init_flag: 12,
            owner_pid: 16,
            sem: 24,
            device_num: 56,
            uuids: 64,
            limit: 1600,
            sm_limit: 1728,
            procs: 1856,
            proc_num: 2_008_896,
            utilization_switch: 2_008_900,
            recent_kernel: 2_008_904,
            priority: 2_008_908,
            last_kernel_time: 2_008_912,
            sem_postinit: 2_008_920,
        }
        HamiProcSlot: 1960 bytes {
            pid: 0,
            hostpid: 4,
            used: 8,
            monitorused: 1032,
            device_util: 1160,
            status: 1928,
            seqlock: 1936,
            unused: 1944,
        }
        HamiDeviceMemory: 64 bytes {
            context_size: 0,
            module_size: 8,
            data_size: 16,
            offset: 24,
            total: 32,
        }
        HamiDeviceUtil: 48 bytes {
            dec_util: 0,
            enc_util: 8,
            sm_util: 16,
        }
    }
    assert!(size_of::<[[AtomicU8; UUID_LEN]; MAX_DEVICES]>() == 16 * 96);

    assert!(EXT_OFFSET == 2_008_960);
    assert!(EXT_OFFSET % 64 == 0);
    assert!(size_of::<ExtHeader>() == 64);
    assert!(size_of::<DeviceRecord>() == 64);
    assert!(size_of::<SlotRecord>() % 64 == 0);
    assert!(offset_of!(Extension, devices) == 64);
    assert!(size_of::<Extension>() < u32::MAX as usize);
    assert!(BASE_FILE_LEN == 2_599_872);
    // Minor version 1 only appends: the header keeps its size, the base its length.
    assert!(offset_of!(ExtHeader, minor_version) == 48);
    assert!(size_of::<SlotPublish>() == 192);
    assert!(TIMES_OFFSET % 64 == 0);
    assert!(MINOR1_FILE_LEN == 2_599_872 + 1024 * 192);
    // Minor version 2 only appends too, and uses what was padding in DeviceRecord.
    assert!(HOST_OFFSET % 64 == 0);
    assert!(offset_of!(DeviceRecord, host_total) == 16);
    assert!(FILE_LEN == MINOR1_FILE_LEN + 1024 * 16 * 8);
    // Minor version 3 uses padding of DeviceRecord only: the file keeps its length.
    assert!(offset_of!(DeviceRecord, oom_refusals) == 40);
    assert!(size_of::<DeviceRecord>() == 64);
    // Minor version 5 uses the trailing padding of SlotRecord (32 bytes after `sm_util`):
    // the record keeps its size, so every slot, the base length and the file stay where
    // they were.
    assert!(offset_of!(SlotRecord, sm_util) + MAX_DEVICES * 8 == 544);
    assert!(offset_of!(SlotRecord, kept_ident) == 544);
    assert!(offset_of!(SlotRecord, kept_host) == 552);
    assert!(size_of::<SlotRecord>() == 576);
};

/// Byte offsets of fields other code (tests, the monitor emulation, validation) needs by number.
pub mod offsets {
    use super::*;
    /// `initialized_flag`.
    pub const INITIALIZED_FLAG: usize = offset_of!(HamiRegion, initialized_flag);
    /// `major_version`.
    pub const MAJOR_VERSION: usize = offset_of!(HamiRegion, major_version);
    /// `minor_version`.
    pub const MINOR_VERSION: usize = offset_of!(HamiRegion, minor_version);
    /// `device_num`.
    pub const DEVICE_NUM: usize = offset_of!(HamiRegion, device_num);
    /// `uuids[0]` (each [`UUID_LEN`] bytes).
    pub const UUIDS: usize = offset_of!(HamiRegion, uuids);
    /// `limit[0]`.
    pub const LIMIT: usize = offset_of!(HamiRegion, limit);
    /// `sm_limit[0]`.
    pub const SM_LIMIT: usize = offset_of!(HamiRegion, sm_limit);
    /// `procs[0]`.
    pub const PROCS: usize = offset_of!(HamiRegion, procs);
    /// Size of one HAMi process slot.
    pub const PROC_SLOT_SIZE: usize = size_of::<HamiProcSlot>();
    /// `proc_num`.
    pub const PROC_NUM: usize = offset_of!(HamiRegion, proc_num);
    /// `utilization_switch`.
    pub const UTILIZATION_SWITCH: usize = offset_of!(HamiRegion, utilization_switch);
    /// `recent_kernel`.
    pub const RECENT_KERNEL: usize = offset_of!(HamiRegion, recent_kernel);
    /// `priority`.
    pub const PRIORITY: usize = offset_of!(HamiRegion, priority);
    /// `last_kernel_time`.
    pub const LAST_KERNEL_TIME: usize = offset_of!(HamiRegion, last_kernel_time);
    /// `uuids[d]`.
    pub const fn uuid(device: usize) -> usize {
        UUIDS + device * UUID_LEN
    }
    /// `limit[d]`.
    pub const fn limit(device: usize) -> usize {
        LIMIT + device * size_of::<u64>()
    }
    /// `sm_limit[d]`.
    pub const fn sm_limit(device: usize) -> usize {
        SM_LIMIT + device * size_of::<u64>()
    }
    /// `procs[j]`.
    pub const fn slot(j: usize) -> usize {
        PROCS + j * PROC_SLOT_SIZE
    }
    /// `procs[j].pid`, relative to the slot.
    pub const SLOT_PID: usize = offset_of!(HamiProcSlot, pid);
    /// `procs[j].hostpid`, relative to the slot.
    pub const SLOT_HOSTPID: usize = offset_of!(HamiProcSlot, hostpid);
    /// `procs[j].status`, relative to the slot.
    pub const SLOT_STATUS: usize = offset_of!(HamiProcSlot, status);
    /// `procs[j].used[d]`, relative to the slot.
    pub const fn slot_memory(device: usize) -> usize {
        offset_of!(HamiProcSlot, used) + device * size_of::<HamiDeviceMemory>()
    }
    /// `procs[j].device_util[d].sm_util`, relative to the slot.
    pub const fn slot_sm_util(device: usize) -> usize {
        offset_of!(HamiProcSlot, device_util)
            + device * size_of::<HamiDeviceUtil>()
            + offset_of!(HamiDeviceUtil, sm_util)
    }
    /// `context_size`, `module_size`, `data_size` of a `device_memory_t` (class order).
    pub const MEMORY_CLASSES: [usize; CLASSES] = [
        offset_of!(HamiDeviceMemory, context_size),
        offset_of!(HamiDeviceMemory, module_size),
        offset_of!(HamiDeviceMemory, data_size),
    ];
    /// `total` of a `device_memory_t`.
    pub const MEMORY_TOTAL: usize = offset_of!(HamiDeviceMemory, total);
    /// Extension magic.
    pub const EXT_MAGIC: usize = EXT_OFFSET + offset_of!(ExtHeader, magic);
    /// Extension version.
    pub const EXT_VERSION: usize = EXT_OFFSET + offset_of!(ExtHeader, version);
    /// Extension size field.
    pub const EXT_SIZE: usize = EXT_OFFSET + offset_of!(ExtHeader, ext_size);
    /// Extension max slots field.
    pub const EXT_MAX_SLOTS: usize = EXT_OFFSET + offset_of!(ExtHeader, max_slots);
    /// Extension max devices field.
    pub const EXT_MAX_DEVICES: usize = EXT_OFFSET + offset_of!(ExtHeader, max_devices);
    /// Extension minor version field.
    pub const EXT_MINOR_VERSION: usize = EXT_OFFSET + offset_of!(ExtHeader, minor_version);
    /// The file's count of swap-out requests (minor version 4).
    pub const EXT_SWAP_REQUESTS: usize = EXT_OFFSET + offset_of!(ExtHeader, swap_requests);
    /// Slot 0's swapped-out word (minor version 4); slot `j`'s is `size_of::<SlotRecord>()`
    /// further per slot.
    pub const SLOT_SWAPPED_OUT: usize =
        EXT_OFFSET + offset_of!(Extension, slots) + offset_of!(SlotRecord, swapped_out);
    /// Size of one slot record.
    pub const SLOT_STRIDE: usize = size_of::<SlotRecord>();
    /// Slot 0's kept-host stamp (minor version 5); slot `j`'s is [`SLOT_STRIDE`] further per
    /// slot.
    pub const SLOT_KEPT_IDENT: usize =
        EXT_OFFSET + offset_of!(Extension, slots) + offset_of!(SlotRecord, kept_ident);
    /// Slot 0's kept host bytes (minor version 5); slot `j`'s is [`SLOT_STRIDE`] further per
    /// slot.
    pub const SLOT_KEPT_HOST: usize =
        EXT_OFFSET + offset_of!(Extension, slots) + offset_of!(SlotRecord, kept_host);
    /// Device `d`'s refusal count is at `DEVICE_OOM_REFUSALS + d * DEVICE_STRIDE`.
    pub const DEVICE_OOM_REFUSALS: usize =
        EXT_OFFSET + offset_of!(Extension, devices) + offset_of!(DeviceRecord, oom_refusals);
    /// Size of one device record.
    pub const DEVICE_STRIDE: usize = size_of::<DeviceRecord>();
}
