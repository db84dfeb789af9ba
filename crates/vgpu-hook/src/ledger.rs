//! The usage ledger behind the allocator: this process's slot in the container's shared
//! table, addressed by the process's own CUDA ordinals.
//!
//! Invariants:
//! - **The file's device index is the GPU**, not a process's ordinal: index i is the GPU
//!   whose UUID is the file's `uuids[i]` (the container's GPUs in NVML's order, whatever the
//!   `CUDA_VISIBLE_DEVICES` of the process that made the file). A process charges its ordinal o on the index whose UUID is
//!   `cuDeviceGetUuid(o)`, so two processes with different `CUDA_VISIBLE_DEVICES` charge,
//!   limit and show each GPU once. The map is built on the first use of an ordinal, which
//!   only CUDA calls make (the process has initialized CUDA then: the hook never does). A
//!   file that names no GPU maps o to o. An ordinal whose GPU the file does not list is
//!   refused, with one line naming the GPU.
//! - **The slot is in the file at the path**: a file unlinked or replaced under its name
//!   splits the container in two ledgers. [`UsageTable::link_state`] is asked on the first
//!   reservation of each second of the coarse monotonic clock (so at most one second after
//!   the previous check, and at most once per second of that clock) and on every refused one;
//!   once the path no longer names our file, new reservations are refused (one line says why
//!   and what to do) and frees still go to the file they were charged in.
//!
//! Views and sub-allocations cost nothing more: the map is one load once built, the link
//! check one coarse clock read and one compare when not due.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use vgpu_alloc_core::{
    DeviceIndex, DeviceUsage, MAX_DEVICES, OutOfMemory, UsageClass, UsageLedger,
};
use vgpu_cuda_abi::CUdevice;
use vgpu_shm::{FileLink, ProcessSlot, UsageTable};

use crate::log::{ERROR, WARN, vlog};

/// The ledger behind the allocator: this process's slot in the container's shared table
/// (`CUDA_DEVICE_MEMORY_SHARED_CACHE`) with the ordinal → GPU map and the link watch.
#[derive(Debug)]
pub(crate) struct SharedLedger {
    slot: ProcessSlot,
    devices: DeviceMap,
    /// Ordinals whose "not in the file" line was written (one bit each).
    unlisted_said: AtomicU32,
    link: LinkWatch,
}

impl SharedLedger {
    pub(crate) fn new(slot: ProcessSlot) -> Self {
        Self {
            slot,
            devices: DeviceMap::new(),
            unlisted_said: AtomicU32::new(0),
            link: LinkWatch::new(),
        }
    }

    /// The slot.
    pub(crate) fn slot(&self) -> &ProcessSlot {
        &self.slot
    }

    /// The file index of CUDA ordinal `ordinal`, building the map on first use. Once built
    /// it is one load and one array index (every reservation and release asks it).
    #[inline]
    pub(crate) fn file_device(&self, ordinal: DeviceIndex) -> Option<DeviceIndex> {
        match self.devices.get(ordinal) {
            Entry::Listed(d) => Some(d),
            Entry::Unlisted => {
                self.say_unlisted(ordinal);
                None
            }
            Entry::Unbuilt => self.file_device_first(ordinal),
            Entry::OutOfRange => None,
        }
    }

    /// [`Self::file_device`] before the map is built: builds it (not kept while the driver
    /// cannot answer: CUDA not initialized yet).
    #[cold]
    #[inline(never)]
    fn file_device_first(&self, ordinal: DeviceIndex) -> Option<DeviceIndex> {
        self.devices.publish(&build_map(self.slot.table())?);
        self.file_device(ordinal)
    }

    /// The ordinal whose GPU is file index `device`, if the map was built (for views from
    /// NVML; never builds it: an NVML-only process must not touch CUDA).
    pub(crate) fn ordinal_of(&self, device: DeviceIndex) -> Option<DeviceIndex> {
        self.devices.ordinal_of(device)
    }

    /// The file index of the GPU with NVML UUID `uuid`.
    pub(crate) fn device_of_uuid(&self, uuid: &str) -> Option<DeviceIndex> {
        let table = self.slot.table();
        (0..table.device_num())
            .map(DeviceIndex)
            .find(|&d| table.uuid(d) == uuid)
    }

    /// Host-backed bytes of file index `device` (all processes).
    pub(crate) fn file_host_used(&self, device: DeviceIndex) -> u64 {
        self.slot.table().host_used(device)
    }

    /// Usage of file index `device` for a view (dead processes swept first).
    pub(crate) fn file_usage_for_view(&self, device: DeviceIndex) -> DeviceUsage {
        sweep_for_view(self.slot.table());
        self.slot.table().usage(device)
    }

    #[cold]
    #[inline(never)]
    fn say_unlisted(&self, ordinal: DeviceIndex) {
        let bit = 1u32 << (ordinal.0 % 32);
        if self.unlisted_said.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
            return;
        }
        let uuid = crate::real::cuda()
            .ok()
            .and_then(|c| crate::driver::device_uuid(c, CUdevice(ordinal.0 as i32)).ok())
            .unwrap_or_default();
        let table = self.slot.table();
        let listed: Vec<String> = (0..table.device_num())
            .map(|d| table.uuid(DeviceIndex(d)))
            .collect();
        vlog!(
            ERROR,
            "device {ordinal} ({uuid}) is not among the GPUs of the shared file {} ({}): the \
             file was made by a process that did not see it, so it has no limit or usage there; \
             allocations on it are refused (run this process with the container's \
             CUDA_VISIBLE_DEVICES, or give it a file of its own)",
            table.path().display(),
            listed.join(", ")
        );
    }

    /// The slot refused a reservation for ordinal `device`: the refusal by ordinal, after
    /// checking the link now (a refusal may come from a ledger split: say so if it is one).
    #[cold]
    #[inline(never)]
    fn refused(&self, device: DeviceIndex, oom: OutOfMemory) -> OutOfMemory {
        self.attached(true);
        OutOfMemory { device, ..oom }
    }

    /// Whether new reservations may go to this file (see the module's second invariant).
    #[inline]
    fn attached(&self, force: bool) -> bool {
        self.link.attached(self.slot.table(), force)
    }
}

/// The ordinal → file index map: one word per ordinal, so that the lookup every reservation
/// and release makes is one load and one compare. Built once, all ordinals at once (racing
/// builders write the same words: the driver answers them alike).
#[derive(Debug)]
struct DeviceMap {
    /// [`UNBUILT`], [`UNLISTED`] or the file index + 1.
    words: [AtomicU32; MAX_DEVICES],
    /// Every word is written (views read the whole map only then).
    built: AtomicBool,
}

const UNBUILT: u32 = 0;
const UNLISTED: u32 = u32::MAX;

/// One ordinal's word of the [`DeviceMap`].
enum Entry {
    Listed(DeviceIndex),
    Unlisted,
    Unbuilt,
    OutOfRange,
}

impl DeviceMap {
    fn new() -> Self {
        Self {
            words: std::array::from_fn(|_| AtomicU32::new(UNBUILT)),
            built: AtomicBool::new(false),
        }
    }

    #[inline]
    fn get(&self, ordinal: DeviceIndex) -> Entry {
        let Some(word) = self.words.get(ordinal.as_usize()) else {
            return Entry::OutOfRange;
        };
        match word.load(Ordering::Relaxed) {
            UNBUILT => Entry::Unbuilt,
            UNLISTED => Entry::Unlisted,
            w => Entry::Listed(DeviceIndex(w - 1)),
        }
    }

    fn publish(&self, map: &[Option<DeviceIndex>; MAX_DEVICES]) {
        for (word, d) in self.words.iter().zip(map) {
            word.store(d.map_or(UNLISTED, |d| d.0 + 1), Ordering::Relaxed);
        }
        self.built.store(true, Ordering::Release);
    }

    fn ordinal_of(&self, device: DeviceIndex) -> Option<DeviceIndex> {
        if !self.built.load(Ordering::Acquire) {
            return None;
        }
        let word = device.0.checked_add(1)?;
        self.words
            .iter()
            .position(|w| w.load(Ordering::Relaxed) == word)
            .map(|o| DeviceIndex(o as u32))
    }
}

/// Builds the ordinal → file index map from the driver's UUIDs; `None` when the driver
/// cannot count its devices (CUDA not initialized by the program).
fn build_map(table: &UsageTable) -> Option<[Option<DeviceIndex>; MAX_DEVICES]> {
    let identity = || std::array::from_fn(|o| Some(DeviceIndex(o as u32)));
    let file: Vec<String> = (0..table.device_num())
        .map(|d| table.uuid(DeviceIndex(d)))
        .collect();
    // A file that names no GPU: ordinals are its indices (what it was made with). No
    // driver at all (unit tests): nothing to map.
    if file.iter().all(String::is_empty) {
        return Some(identity());
    }
    let Ok(cuda) = crate::real::cuda() else {
        return Some(identity());
    };
    let n = crate::driver::device_count(cuda)
        .ok()?
        .clamp(0, MAX_DEVICES as i32);
    let mut map = [None; MAX_DEVICES];
    for o in 0..n {
        let uuid = crate::driver::device_uuid(cuda, CUdevice(o)).unwrap_or_default();
        map[o as usize] = file
            .iter()
            .position(|u| !uuid.is_empty() && *u == uuid)
            .map(|i| DeviceIndex(i as u32));
    }
    Some(map)
}

/// Watches that the table's path still names the file this process charges.
#[derive(Debug)]
struct LinkWatch {
    /// The coarse monotonic second ([`vgpu_shm::monotonic_coarse_secs`]) from which the next
    /// check is due: 0 at first and once detached (always due: the due path answers).
    due_from: AtomicU64,
    detached: AtomicBool,
}

impl LinkWatch {
    fn new() -> Self {
        Self {
            due_from: AtomicU64::new(0),
            detached: AtomicBool::new(false),
        }
    }

    /// False once the path names another file or none (said once). Checked when due, or now
    /// with `force`. Not due: one coarse clock read, one load and one compare.
    #[inline]
    fn attached(&self, table: &UsageTable, force: bool) -> bool {
        let now = vgpu_shm::monotonic_coarse_secs();
        let due_from = self.due_from.load(Ordering::Relaxed);
        if !force && now < due_from {
            return true;
        }
        self.check(table, now, due_from)
    }

    /// The due check of [`Self::attached`]: one racing thread claims it and asks the file.
    #[cold]
    #[inline(never)]
    fn check(&self, table: &UsageTable, now: u64, due_from: u64) -> bool {
        if self.detached.load(Ordering::Relaxed) {
            self.due_from.store(0, Ordering::Relaxed);
            return false;
        }
        if self
            .due_from
            .compare_exchange(due_from, now + 1, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return true;
        }
        let what = match table.link_state() {
            Ok(FileLink::Linked) => return true,
            Ok(FileLink::Unlinked) => "was removed",
            Ok(FileLink::Replaced) => "was replaced by another file",
            Err(e) => {
                vlog!(
                    WARN,
                    "cannot check the shared file {}: {e}",
                    table.path().display()
                );
                return true;
            }
        };
        // Every later reservation takes the due path, which answers from the flag.
        self.due_from.store(0, Ordering::Relaxed);
        if !self.detached.swap(true, Ordering::Relaxed) {
            vlog!(
                ERROR,
                "the shared file {} {what} while this process used it: processes started since \
                 count in another file, so this one no longer sees the container's usage. New \
                 allocations are refused (frees still work); restart the process to join the \
                 file now at that path",
                table.path().display()
            );
        }
        false
    }
}

/// A refusal that is not the limit's (GPU not in the file, file detached): the hook's own
/// line said why.
fn refusal(device: DeviceIndex, bytes: u64) -> OutOfMemory {
    OutOfMemory {
        device,
        requested: bytes,
        in_use: 0,
        limit: 0,
    }
}

/// Views sweep dead processes at most once a millisecond: a program polling
/// `cuMemGetInfo` in a loop must not pay one lock probe per process on every call.
fn sweep_for_view(table: &UsageTable) {
    static LAST_SWEEP_NS: AtomicU64 = AtomicU64::new(0);
    let now = vgpu_shm::monotonic_ns();
    let last = LAST_SWEEP_NS.load(Ordering::Relaxed);
    let due = (last == 0 || now.saturating_sub(last) >= 1_000_000)
        && LAST_SWEEP_NS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok();
    if due {
        let _ = table.sweep_dead();
    }
}

/// The host-backed class (`crate::host_backing`), by ordinal like the other classes.
impl SharedLedger {
    /// `f` (a reservation) on this process's slot with ordinal `device`'s file index, if the
    /// file lists that GPU and is still at its path; a refusal is by ordinal and checks the
    /// link now (what every reservation of the ledger goes through).
    #[inline]
    fn reserve_on_file(
        &self,
        device: DeviceIndex,
        bytes: u64,
        f: impl FnOnce(&ProcessSlot, DeviceIndex) -> Result<(), OutOfMemory>,
    ) -> Result<(), OutOfMemory> {
        match self.file_device(device) {
            Some(d) if self.attached(false) => {
                f(&self.slot, d).map_err(|oom| self.refused(device, oom))
            }
            _ => Err(refusal(device, bytes)),
        }
    }

    /// Reserve `bytes` of host-backed memory at ordinal `device`'s addresses.
    pub(crate) fn try_reserve_host(
        &self,
        device: DeviceIndex,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        self.reserve_on_file(device, bytes, |s, d| s.try_reserve_host(d, bytes))
    }

    /// Reserve device room for host-backed bytes moving onto ordinal `device`.
    pub(crate) fn try_reserve_move(
        &self,
        device: DeviceIndex,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        self.reserve_on_file(device, bytes, |s, d| s.try_reserve_move(d, bytes))
    }

    /// Charge device memory about to be swapped out at ordinal `device` as host-backed bytes
    /// (no bound: the bytes move between classes; docs/swap.md).
    pub(crate) fn reserve_swap_out(
        &self,
        device: DeviceIndex,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        self.reserve_on_file(device, bytes, |s, d| s.reserve_swap_out(d, bytes))
    }

    /// Release host-backed bytes at ordinal `device`'s addresses (into the file they were
    /// charged in).
    pub(crate) fn release_host(&self, device: DeviceIndex, bytes: u64) {
        if let Some(d) = self.file_device(device) {
            self.slot.release_host(d, bytes);
        }
    }

    /// Count a refusal by the limit of ordinal `device` in the file (cold: the refusal path).
    pub(crate) fn count_refusal(&self, device: DeviceIndex) {
        if let Some(d) = self.file_device(device) {
            self.slot.table().count_refusal(d);
        }
    }

    /// Host-backed bytes of all processes at ordinal `device`'s addresses.
    pub(crate) fn host_used(&self, device: DeviceIndex) -> u64 {
        self.file_device(device)
            .map_or(0, |d| self.file_host_used(d))
    }
}

impl UsageLedger for SharedLedger {
    fn try_reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        self.reserve_on_file(device, bytes, |s, d| s.try_reserve(d, class, bytes))
    }

    fn release(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        if let Some(d) = self.file_device(device) {
            self.slot.release(d, class, bytes);
        }
    }

    fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        match self.file_device(device) {
            Some(d) => self.slot.table().usage(d),
            // Not the container's GPU: nothing of it may be used.
            None => DeviceUsage {
                used: 0,
                limit: Some(0),
            },
        }
    }

    /// The slot accounts every device of the file; an ordinal the file does not list is left
    /// to `try_reserve`, which refuses it with the line naming the GPU.
    fn has_device(&self, _device: DeviceIndex) -> bool {
        true
    }

    fn charge_over_limit(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        if let Some(d) = self.file_device(device) {
            self.slot.charge_over_limit(d, class, bytes);
        }
    }
}

impl SharedLedger {
    /// Bytes this process holds on `device` (an ordinal), every class.
    pub(crate) fn held_by_self(&self, device: DeviceIndex) -> u64 {
        self.file_device(device).map_or(0, |d| {
            let h = self.slot.held(d);
            h.context.saturating_add(h.module).saturating_add(h.data)
        })
    }

    /// The pid NVML lists this process under: the host pid the monitor wrote into the shared
    /// file, else `getpid()`.
    pub(crate) fn nvml_pid(&self) -> u32 {
        self.slot
            .hostpid()
            .map_or_else(std::process::id, |h| h as u32)
    }

    /// Usage of ordinal `device` for a view (`cuMemGetInfo`): first gives dead processes'
    /// usage back, so a process that just exited is not shown as still holding memory. Not for
    /// allocation paths (refused reservations sweep by themselves).
    pub(crate) fn usage_for_view(&self, device: DeviceIndex) -> DeviceUsage {
        sweep_for_view(self.slot.table());
        self.usage(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_map_answers_by_ordinal_once_built() {
        let map = DeviceMap::new();
        assert!(matches!(map.get(DeviceIndex(0)), Entry::Unbuilt));
        assert_eq!(
            map.ordinal_of(DeviceIndex(0)),
            None,
            "not built: views ask nothing"
        );
        let mut built = [None; MAX_DEVICES];
        built[0] = Some(DeviceIndex(1));
        built[1] = Some(DeviceIndex(0));
        map.publish(&built);
        assert!(matches!(
            map.get(DeviceIndex(0)),
            Entry::Listed(DeviceIndex(1))
        ));
        assert!(matches!(
            map.get(DeviceIndex(1)),
            Entry::Listed(DeviceIndex(0))
        ));
        assert!(matches!(map.get(DeviceIndex(2)), Entry::Unlisted));
        assert!(matches!(
            map.get(DeviceIndex(MAX_DEVICES as u32)),
            Entry::OutOfRange
        ));
        assert_eq!(map.ordinal_of(DeviceIndex(0)), Some(DeviceIndex(1)));
        assert_eq!(map.ordinal_of(DeviceIndex(5)), None);
        assert_eq!(map.ordinal_of(DeviceIndex(u32::MAX)), None);
    }

    /// A fresh shared file at a scratch path named after `name`, and a watch on it.
    fn watched_table(name: &str) -> (std::path::PathBuf, UsageTable, LinkWatch) {
        let path = std::env::temp_dir().join(format!("vgpu-hook-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let table = UsageTable::open_or_create(&path, &Default::default()).expect("open");
        (path, table, LinkWatch::new())
    }

    #[test]
    fn the_link_watch_refuses_once_the_path_names_another_file() {
        let (path, table, watch) = watched_table("link");
        assert!(
            watch.attached(&table, false),
            "the first reservation checks: linked"
        );
        std::fs::remove_file(&path).expect("unlink");
        std::fs::write(&path, b"").expect("another file at the path");
        // Not due within the second of the first check (unless the coarse second just turned),
        // but a refusal's forced check sees it, and from then on every reservation is refused.
        assert!(
            !watch.attached(&table, true),
            "the forced check sees the replacement"
        );
        assert!(!watch.attached(&table, false));
        assert!(!watch.attached(&table, false), "stays detached");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn the_link_watch_checks_again_once_the_coarse_second_turns() {
        let (path, table, watch) = watched_table("link2");
        assert!(watch.attached(&table, false));
        std::fs::remove_file(&path).expect("unlink");
        // The bound the docs state: a reservation more than a second after the last check
        // checks (the coarse clock lags by at most a tick, a few milliseconds).
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(!watch.attached(&table, false), "due again: sees the unlink");
    }
}
