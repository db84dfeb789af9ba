//! [`UsageTable`] (an attached file) and [`ProcessSlot`] (this process's registration).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vgpu_alloc_core::{DeviceIndex, DeviceUsage, OutOfMemory, UsageClass, UsageLedger};

use crate::error::{ImageError, ShmError};
use crate::layout::{
    self, BASE_FILE_LEN, CLASSES, EXT_MAGIC, EXT_VERSION, Extension, FILE_LEN, HAMI_MAGIC,
    HAMI_MAJOR, HAMI_MINOR, HAMI_STATUS_RUNNING, HAMI_STATUS_SUSPENDED, HamiProcSlot, HamiRegion,
    MAX_DEVICES, MAX_SLOTS, PublishTimes, SlotRecord, UUID_LEN,
};
use crate::protocol::{self, NoCrash, STATE_FREE, STATE_LIVE, Store, ident_word, split_ident};
use crate::sys::{self, Mapping};
use crate::validate::validate;

/// OFD lock byte of the administrative lock (beyond the end of the file, touching no data).
const ADMIN_LOCK_OFFSET: u64 = 1 << 40;
/// OFD lock byte of slot `j` is `SLOT_LOCK_BASE + j`; held by the slot's process while alive.
const SLOT_LOCK_BASE: u64 = ADMIN_LOCK_OFFSET + 64;
/// How long `open` waits for another process's initialization.
const INIT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long register/deregister/sweep wait for another administrator.
const ADMIN_LOCK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a refused reservation or a snapshot waits to sweep dead processes before giving up.
const SWEEP_LOCK_TIMEOUT: Duration = Duration::from_millis(100);
/// `recent_kernel` as HAMi-core writes it on launches ("this task is active").
pub const RECENT_KERNEL_ACTIVE: i32 = 2;
/// How long [`ProcessSlot::leave`] waits for the locks it needs (it runs at process exit, which
/// must not hang).
const LEAVE_TIMEOUT: Duration = Duration::from_secs(1);

/// What a newly created file is initialized with. Ignored when the file already exists:
/// limits stored in an existing file win (as in HAMi-core).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableInit {
    /// NVML UUIDs in NVML index order; their count is the file's `device_num` (at most 16).
    pub uuids: Vec<String>,
    /// Memory limit per device in bytes (`None`, `Some(0)` or missing = unlimited).
    pub memory_limits: Vec<Option<u64>>,
    /// SM limit per device in percent, at most 100 (`None`, 0, 100 or missing = unlimited).
    pub sm_limits: Vec<Option<u64>>,
    /// `CUDA_TASK_PRIORITY` (HAMi's default is 1).
    pub priority: i32,
}

impl TableInit {
    fn check(&self) -> Result<(), ShmError> {
        let invalid = |what, value: String| Err(ShmError::InvalidValue { what, value });
        if self.uuids.len() > MAX_DEVICES {
            return invalid("device count", self.uuids.len().to_string());
        }
        if self.memory_limits.len() > MAX_DEVICES || self.sm_limits.len() > MAX_DEVICES {
            return invalid("limit count", format!("{}", self.memory_limits.len()));
        }
        if let Some(u) = self.uuids.iter().find(|u| u.len() >= UUID_LEN) {
            return invalid("uuid (too long)", u.clone());
        }
        // As in HAMi, a limit of 0 means unlimited (stored as 0).
        if let Some(p) = self.sm_limits.iter().flatten().find(|&&p| p > 100) {
            return invalid("SM limit percent", p.to_string());
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    map: Mapping,
    /// Holds the administrative lock and this process's slot liveness locks; never mapped
    /// (a mapping keeps its open file description alive in forked children). `None` read-only.
    lock_file: Option<File>,
    /// Asks whether others hold locks; never holds any itself.
    probe_file: File,
    /// Serializes this process's administrators (OFD locks do not exclude threads sharing one).
    admin: Mutex<()>,
    fork_epoch: u64,
    created: bool,
    /// Seconds since the epoch of this handle's last periodic sweep.
    last_periodic_sweep: std::sync::atomic::AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let forked = sys::fork_epoch() != self.fork_epoch;
        if let Some(f) = self.lock_file.take() {
            use std::os::fd::{AsRawFd, IntoRawFd};
            if forked {
                // The fork handler closed our copy already; the number may be reused.
                let _ = f.into_raw_fd();
            } else {
                sys::unregister_fork_fd(f.as_raw_fd());
            }
        }
    }
}

/// An attached shared usage table (cheap to clone).
#[derive(Debug, Clone)]
pub struct UsageTable {
    inner: Arc<Inner>,
}

/// The protocol's view of the mapped file.
pub(crate) struct Mapped<'a> {
    region: &'a HamiRegion,
    ext: &'a Extension,
    probe: &'a File,
}

fn class_index(class: UsageClass) -> usize {
    match class {
        UsageClass::Context => 0,
        UsageClass::Module => 1,
        UsageClass::Data => 2,
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Mapped<'_> {
    fn proc_of(&self, slot: usize) -> Option<&HamiProcSlot> {
        let index = self.ext.slots.get(slot)?.hami_index.load(Ordering::Relaxed) as usize;
        self.region.procs.get(index)
    }

    /// Write HAMi slot `index` entirely from slot record `slot`.
    fn write_proc(&self, index: usize, slot: usize, hostpid: i32) {
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

    fn clear_proc(&self, index: usize) {
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
        &self.ext.slots[slot].held[device][class]
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
    /// Last reported SM utilization, percent.
    pub sm_util: u64,
    /// When `sm_util` was reported: `CLOCK_MONOTONIC` nanoseconds (one clock for every
    /// process of the host). `None` when unknown: reported without a time, by a library that
    /// writes none, or the file has no time table.
    pub sm_util_at: Option<u64>,
}

impl ProcessDeviceUsage {
    /// All bytes.
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
}

/// Releases the init `flock` however `open` leaves.
struct FlockGuard<'a>(&'a File);
impl Drop for FlockGuard<'_> {
    fn drop(&mut self) {
        sys::unflock(self.0);
    }
}

/// Opens `path` read-write, creating it with mode 0666 whatever the umask (every container
/// and user of the node may need it; the umask is left alone). On error, the failed step.
pub(crate) fn open_or_create_shared(path: &Path) -> Result<File, (&'static str, io::Error)> {
    match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(path)
    {
        Ok(f) => {
            // The umask may have masked bits; set them without touching the umask.
            f.set_permissions(std::fs::Permissions::from_mode(0o666))
                .map_err(|e| ("fchmod", e))?;
            Ok(f)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| ("open", e)),
        Err(e) => Err(("create", e)),
    }
}

impl UsageTable {
    /// Attach to the table at `path`, creating and initializing it from `init` if it does not
    /// exist (mode 0666, whatever the umask). An existing file keeps its limits.
    pub fn open_or_create(path: impl AsRef<Path>, init: &TableInit) -> Result<Self, ShmError> {
        init.check()?;
        Self::open(path.as_ref(), Some(init), true)
    }

    /// Attach read-write to an existing table.
    pub fn open_existing(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        Self::open(path.as_ref(), None, true)
    }

    /// Attach read-only (inspection; no sweeping, no writes).
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        Self::open(path.as_ref(), None, false)
    }

    fn open(path: &Path, init: Option<&TableInit>, writable: bool) -> Result<Self, ShmError> {
        let io = |op: &'static str| {
            let path = path.to_path_buf();
            move |source: io::Error| ShmError::Io { path, op, source }
        };
        let invalid = |source: ImageError| ShmError::InvalidFile {
            path: path.to_path_buf(),
            source,
        };
        let file = match init {
            Some(_) => open_or_create_shared(path).map_err(|(op, e)| io(op)(e))?,
            None => OpenOptions::new()
                .read(true)
                .write(writable)
                .open(path)
                .map_err(io("open"))?,
        };
        let meta = file.metadata().map_err(io("fstat"))?;
        if !meta.is_file() {
            return Err(io("open")(io::Error::other("not a regular file")));
        }

        // Initialization (and the check that it is finished) happen under flock.
        let deadline = Instant::now() + INIT_LOCK_TIMEOUT;
        while !sys::try_flock_exclusive(&file).map_err(io("flock"))? {
            if Instant::now() > deadline {
                return Err(ShmError::InitLockTimeout {
                    path: path.to_path_buf(),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let guard = FlockGuard(&file);
        let len = file.metadata().map_err(io("fstat"))?.len();
        let mut created = false;
        let map = if len == 0 && init.is_some() {
            created = true;
            Self::initialize(&file, init.unwrap_or(&TableInit::default()))
                .map_err(io("initialize"))?
        } else {
            let map_len = usize::try_from(len.min(FILE_LEN as u64)).unwrap_or(FILE_LEN);
            let map = Mapping::map(&file, map_len.max(1), writable).map_err(io("mmap"))?;
            // Report the real length, not the mapped one.
            match validate(&map) {
                Ok(info) if info.minor_version == 0 && writable => {
                    // Written by a library from before the publish-time table: append it.
                    drop(map);
                    Self::upgrade(&file, len).map_err(io("upgrade"))?
                }
                Ok(_) if len >= BASE_FILE_LEN as u64 => map,
                Ok(_) => unreachable_truncated(len).map_err(invalid)?,
                Err(ImageError::Uninitialized) if init.is_some() => {
                    drop(map);
                    created = true;
                    Self::initialize(&file, init.unwrap_or(&TableInit::default()))
                        .map_err(io("initialize"))?
                }
                Err(ImageError::Truncated { .. }) => unreachable_truncated(len).map_err(invalid)?,
                Err(e) => return Err(invalid(e)),
            }
        };
        drop(guard);

        // Separate open file descriptions of the same inode for the OFD locks (see `Inner`).
        let reopen = |write: bool| -> Result<File, ShmError> {
            let f = OpenOptions::new()
                .read(true)
                .write(write)
                .open(path)
                .map_err(io("reopen"))?;
            let m = f.metadata().map_err(io("fstat"))?;
            if (m.dev(), m.ino()) != (meta.dev(), meta.ino()) {
                return Err(io("reopen")(io::Error::other(
                    "file was replaced while opening",
                )));
            }
            Ok(f)
        };
        let lock_file = if writable { Some(reopen(true)?) } else { None };
        let probe_file = reopen(false)?;
        if let Some(f) = &lock_file {
            use std::os::fd::AsRawFd;
            sys::register_fork_fd(f.as_raw_fd());
        }
        drop(file); // the mapping keeps what it needs
        let table = Self {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                map,
                lock_file,
                probe_file,
                admin: Mutex::new(()),
                fork_epoch: sys::fork_epoch(),
                created,
                last_periodic_sweep: std::sync::atomic::AtomicU64::new(now_secs()),
            }),
        };
        if writable {
            // Attaching is one of the moments dead processes' usage returns to the pool.
            let _ = table.sweep_with_timeout(SWEEP_LOCK_TIMEOUT);
        }
        Ok(table)
    }

    /// Append the publish-time table (extension minor version 1) to a valid minor-0 file
    /// (caller holds the init flock). Everything before it stays as it is, so processes of
    /// older libraries that map only the base keep working; they never read the new part.
    fn upgrade(file: &File, len: u64) -> io::Result<Mapping> {
        // Growing zero-fills; a longer file is never cut.
        if len < FILE_LEN as u64 {
            file.set_len(FILE_LEN as u64)?;
        }
        let map = Mapping::map(file, FILE_LEN, true)?;
        let (Some(ext), Some(times)) = (map.extension(), map.publish_times()) else {
            return Err(io::Error::other("mapping shorter than the table"));
        };
        // Whatever lay beyond the base belongs to nobody yet (the minor version says 0).
        for slot in &times.slots {
            slot.ident.store(0, Ordering::Relaxed);
            for at in &slot.sm_util_at {
                at.store(0, Ordering::Relaxed);
            }
        }
        ext.header
            .minor_version
            .store(layout::EXT_MINOR, Ordering::Release);
        Ok(map)
    }

    /// Size the file and write a fresh table (caller holds the init flock).
    fn initialize(file: &File, init: &TableInit) -> io::Result<Mapping> {
        // Truncating to 0 first zero-fills whatever an interrupted initializer left.
        file.set_len(0)?;
        file.set_len(FILE_LEN as u64)?;
        let map = Mapping::map(file, FILE_LEN, true)?;
        let (Some(region), Some(ext)) = (map.region(), map.extension()) else {
            return Err(io::Error::other("mapping shorter than the table"));
        };
        write_fresh(region, ext, init);
        Ok(map)
    }

    /// The path the table was opened at.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Whether this handle initialized the file (else it found an initialized table).
    pub fn created(&self) -> bool {
        self.inner.created
    }

    /// Whether the handle can write.
    pub fn is_writable(&self) -> bool {
        self.inner.lock_file.is_some()
    }

    pub(crate) fn region(&self) -> &HamiRegion {
        // Attach only succeeds with a mapping of at least FILE_LEN bytes.
        self.inner
            .map
            .region()
            .expect("mapping validated at attach")
    }

    pub(crate) fn ext(&self) -> &Extension {
        self.inner
            .map
            .extension()
            .expect("mapping validated at attach")
    }

    /// The publish-time table, when the file has it (minor version ≥ 1 when attached).
    pub(crate) fn times(&self) -> Option<&PublishTimes> {
        if self.ext().header.minor_version.load(Ordering::Acquire) < 1 {
            return None;
        }
        self.inner.map.publish_times()
    }

    pub(crate) fn store(&self) -> Mapped<'_> {
        Mapped {
            region: self.region(),
            ext: self.ext(),
            probe: &self.inner.probe_file,
        }
    }

    fn check_writable(&self) -> Result<&File, ShmError> {
        if sys::fork_epoch() != self.inner.fork_epoch {
            return Err(ShmError::Forked);
        }
        self.inner.lock_file.as_ref().ok_or(ShmError::ReadOnly)
    }

    /// Run `f` as the administrator: the in-process mutex, then the cross-process OFD lock
    /// (waiting at most `timeout`), a fresh admin epoch, and the repair of whatever a previous
    /// administrator killed inside left behind.
    fn admin<R>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&Mapped<'_>, u64) -> Result<R, ShmError>,
    ) -> Result<R, ShmError> {
        let lock_file = self.check_writable()?;
        let deadline = Instant::now() + timeout;
        // Polled, not blocking: `leave` runs at exit, possibly in a signal handler that
        // interrupted this very thread inside an administrative section.
        let _local = loop {
            match self.inner.admin.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(ShmError::AdminLockTimeout {
                        path: self.inner.path.clone(),
                    });
                }
            }
        };
        loop {
            match sys::ofd_try_lock(lock_file, ADMIN_LOCK_OFFSET) {
                Ok(true) => break,
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                Ok(false) => {
                    return Err(ShmError::AdminLockTimeout {
                        path: self.inner.path.clone(),
                    });
                }
                Err(source) => {
                    return Err(ShmError::Io {
                        path: self.inner.path.clone(),
                        op: "fcntl",
                        source,
                    });
                }
            }
        }
        struct Release<'a>(&'a File);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                sys::ofd_unlock(self.0, ADMIN_LOCK_OFFSET);
            }
        }
        let _release = Release(lock_file);
        let st = self.store();
        let header = &self.ext().header;
        let epoch = header
            .admin_epoch
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1);
        let me = protocol::admin_owner_word(epoch);
        if header.admin_dirty.swap(1, Ordering::AcqRel) != 0 {
            // The previous administrator died inside: repair everything it may have touched.
            let dead = protocol::find_dead(&st);
            let _ = protocol::normalize(&st, me, &dead, &NoCrash);
        }
        let result = f(&st, me);
        header.admin_dirty.store(0, Ordering::Release);
        result
    }

    /// Give dead processes' usage back to the pool now. Returns how many slots were freed.
    pub fn sweep_dead(&self) -> Result<usize, ShmError> {
        self.sweep_with_timeout(ADMIN_LOCK_TIMEOUT)
    }

    fn sweep_with_timeout(&self, timeout: Duration) -> Result<usize, ShmError> {
        // Probing without the lock first keeps the common case (nobody died) cheap. A set
        // `admin_dirty` means an administrator is at work or died inside (then `admin` repairs).
        let dirty = self.ext().header.admin_dirty.load(Ordering::Acquire) != 0;
        if !dirty && protocol::find_dead(&self.store()).is_empty() {
            return Ok(0);
        }
        self.admin(timeout, |st, me| {
            let dead = protocol::find_dead(st);
            if dead.is_empty() {
                return Ok(0);
            }
            Ok(protocol::release_dead(st, me, &dead, &NoCrash).unwrap_or(0))
        })
    }

    /// Sweep if this handle has not in the last second (cheap when nobody died: one probe per
    /// live slot, no lock).
    fn periodic_sweep(&self) {
        let now = now_secs();
        let last = &self.inner.last_periodic_sweep;
        let prev = last.load(Ordering::Relaxed);
        if now > prev
            && last
                .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let _ = self.sweep_with_timeout(Duration::ZERO);
        }
    }

    /// Register the calling process: take a free slot, hold its liveness lock, publish it in
    /// HAMi's `procs[]`. Fails with [`ShmError::TableFull`] when 1,024 live processes hold slots.
    pub fn register_self(&self) -> Result<ProcessSlot, ShmError> {
        let lock_file = self.check_writable()?;
        let pid = std::process::id() as i32;
        let start_time = sys::process_start_time(pid).unwrap_or(0);
        let (index, generation) = self.admin(ADMIN_LOCK_TIMEOUT, |st, me| {
            for attempt in 0..2 {
                if let Some(found) = self.claim_free_slot(st, lock_file, pid, start_time)? {
                    return Ok(found);
                }
                if attempt == 0 {
                    // Full: dead processes may be holding slots.
                    let dead = protocol::find_dead(st);
                    let _ = protocol::normalize(st, me, &dead, &NoCrash);
                }
            }
            Err(ShmError::TableFull {
                path: self.inner.path.clone(),
                slots: MAX_SLOTS,
            })
        })?;
        Ok(ProcessSlot {
            table: self.clone(),
            index,
            owner: AtomicU64::new(protocol::slot_owner_word(index, generation)),
            fork_epoch: self.inner.fork_epoch,
        })
    }

    fn claim_free_slot(
        &self,
        st: &Mapped<'_>,
        lock_file: &File,
        pid: i32,
        start_time: u64,
    ) -> Result<Option<(usize, u32)>, ShmError> {
        let n = st.region.proc_num.load(Ordering::Acquire);
        if !(0..MAX_SLOTS as i32).contains(&n) {
            return Ok(None);
        }
        for (j, rec) in st.ext.slots.iter().enumerate() {
            let (generation, state) = split_ident(rec.ident.load(Ordering::Acquire));
            if state != STATE_FREE {
                continue;
            }
            match sys::ofd_try_lock(lock_file, SLOT_LOCK_BASE + j as u64) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(source) => {
                    return Err(ShmError::Io {
                        path: self.inner.path.clone(),
                        op: "fcntl",
                        source,
                    });
                }
            }
            rec.pid.store(pid, Ordering::Relaxed);
            rec.hostpid.store(0, Ordering::Relaxed);
            rec.start_time.store(start_time, Ordering::Relaxed);
            let generation = generation.wrapping_add(1) & 0x7fff_ffff;
            if let Some(times) = self.times() {
                // The new process has published nothing yet.
                let t = &times.slots[j];
                for at in &t.sm_util_at {
                    at.store(0, Ordering::Relaxed);
                }
                t.ident
                    .store(ident_word(generation, STATE_LIVE), Ordering::Release);
            }
            for device in 0..MAX_DEVICES {
                rec.sm_util[device].store(0, Ordering::Relaxed);
                // A free slot holds nothing (normalize zeroes non-live slots).
                debug_assert!(
                    rec.held[device]
                        .iter()
                        .all(|h| h.load(Ordering::Relaxed) == 0)
                );
            }
            // Appending at `n` moves no live slot, so no device lock is needed.
            st.write_proc(n as usize, j, 0);
            rec.ident
                .store(ident_word(generation, STATE_LIVE), Ordering::Release);
            st.region.proc_num.store(n + 1, Ordering::Release);
            return Ok(Some((j, generation)));
        }
        Ok(None)
    }

    /// Number of devices in the file.
    pub fn device_num(&self) -> u32 {
        self.region()
            .device_num
            .load(Ordering::Relaxed)
            .min(MAX_DEVICES as u64) as u32
    }

    /// NVML UUID of `device` (empty if unset).
    pub fn uuid(&self, device: DeviceIndex) -> String {
        self.region()
            .uuids
            .get(device.as_usize())
            .map(|u| layout::uuid_of(u.iter().map(|b| b.load(Ordering::Relaxed))))
            .unwrap_or_default()
    }

    /// Memory limit of `device` as stored now (`None` = unlimited).
    pub fn memory_limit(&self, device: DeviceIndex) -> Option<u64> {
        let v = self.region().limit.get(device.as_usize())?;
        layout::memory_limit_of(v.load(Ordering::Relaxed))
    }

    /// SM limit of `device` in percent (`None` = unlimited: 0 or >= 100).
    pub fn sm_limit(&self, device: DeviceIndex) -> Option<u64> {
        let v = self.region().sm_limit.get(device.as_usize())?;
        layout::sm_limit_of(v.load(Ordering::Relaxed))
    }

    /// Change the memory limit of `device` on the live file; enforced from the next
    /// reservation on. `None` = unlimited. Usage already above a lowered limit stays until freed.
    pub fn set_memory_limit(
        &self,
        device: DeviceIndex,
        limit: Option<u64>,
    ) -> Result<(), ShmError> {
        self.check_writable()?;
        let slot = self
            .region()
            .limit
            .get(device.as_usize())
            .ok_or(ShmError::InvalidDevice {
                device: device.0,
                max: MAX_DEVICES,
            })?;
        if limit == Some(0) {
            return Err(ShmError::InvalidValue {
                what: "memory limit",
                value: "0 (use None for unlimited)".into(),
            });
        }
        slot.store(limit.unwrap_or(0), Ordering::Release);
        Ok(())
    }

    /// Change the SM limit (percent, 1..=100; `None` = unlimited) of `device` on the live file.
    pub fn set_sm_limit(&self, device: DeviceIndex, percent: Option<u64>) -> Result<(), ShmError> {
        self.check_writable()?;
        let slot =
            self.region()
                .sm_limit
                .get(device.as_usize())
                .ok_or(ShmError::InvalidDevice {
                    device: device.0,
                    max: MAX_DEVICES,
                })?;
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

    /// A picture of the table for `vgpu status` and exporters. Never waits on a dead writer:
    /// it reads without locks; a writable handle first tries (briefly) to sweep dead processes.
    pub fn snapshot(&self) -> TableSnapshot {
        if self.check_writable().is_ok() {
            let _ = self.sweep_with_timeout(SWEEP_LOCK_TIMEOUT);
        }
        let st = self.store();
        let r = st.region;
        let device_num = self.device_num() as usize;
        let mut devices: Vec<DeviceSnapshot> = (0..device_num)
            .map(|d| DeviceSnapshot {
                index: d as u32,
                uuid: self.uuid(DeviceIndex(d as u32)),
                limit: self.memory_limit(DeviceIndex(d as u32)),
                sm_limit: self.sm_limit(DeviceIndex(d as u32)),
                used: st.ext.devices[d].total.load(Ordering::Relaxed),
                context: 0,
                module: 0,
                data: 0,
            })
            .collect();
        let mut processes = Vec::new();
        let times = self.times();
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
            processes.push(ProcessSnapshot {
                slot: j,
                hami_index,
                pid,
                hostpid,
                start_time: rec.start_time.load(Ordering::Relaxed),
                alive: st.probe_slot_alive(j),
                suspended,
                devices: (0..device_num).map(usage).collect(),
            });
        }
        processes.sort_by_key(|p| p.hami_index);
        TableSnapshot {
            devices,
            processes,
            proc_num: r.proc_num.load(Ordering::Relaxed),
            priority: r.priority.load(Ordering::Relaxed),
            recent_kernel: r.recent_kernel.load(Ordering::Relaxed),
            utilization_switch: r.utilization_switch.load(Ordering::Relaxed),
            last_kernel_time: r.last_kernel_time.load(Ordering::Relaxed),
        }
    }
}

fn unreachable_truncated(len: u64) -> Result<Mapping, ImageError> {
    Err(ImageError::Truncated {
        len,
        expected: FILE_LEN as u64,
    })
}

fn write_fresh(region: &HamiRegion, ext: &Extension, init: &TableInit) {
    let r = region;
    r.major_version.store(HAMI_MAJOR, Ordering::Relaxed);
    r.minor_version.store(HAMI_MINOR, Ordering::Relaxed);
    r.owner_pid
        .store(u64::from(std::process::id()), Ordering::Relaxed);
    // A posted glibc semaphore (value 1) in both sem_t fields; vgpu itself never uses them.
    r.sem[0].store(1, Ordering::Relaxed);
    r.sem_postinit[0].store(1, Ordering::Relaxed);
    r.device_num
        .store(init.uuids.len() as u64, Ordering::Relaxed);
    for (d, uuid) in init.uuids.iter().enumerate().take(MAX_DEVICES) {
        for (dst, &b) in r.uuids[d]
            .iter()
            .zip(uuid.as_bytes().iter().take(UUID_LEN - 1))
        {
            dst.store(b, Ordering::Relaxed);
        }
    }
    for d in 0..MAX_DEVICES {
        let mem = init.memory_limits.get(d).copied().flatten().unwrap_or(0);
        r.limit[d].store(mem, Ordering::Relaxed);
        let sm = init.sm_limits.get(d).copied().flatten().unwrap_or(0);
        r.sm_limit[d].store(sm, Ordering::Relaxed);
    }
    r.priority.store(init.priority, Ordering::Relaxed);
    let h = &ext.header;
    h.version.store(EXT_VERSION, Ordering::Relaxed);
    h.ext_size
        .store(size_of::<Extension>() as u32, Ordering::Relaxed);
    h.max_slots.store(MAX_SLOTS as u32, Ordering::Relaxed);
    h.max_devices.store(MAX_DEVICES as u32, Ordering::Relaxed);
    h.admin_epoch.store(1, Ordering::Relaxed);
    h.created_at.store(now_secs(), Ordering::Relaxed);
    h.minor_version.store(layout::EXT_MINOR, Ordering::Relaxed);
    h.magic.store(EXT_MAGIC, Ordering::Release);
    // Last: the monitor and other processes treat the file as initialized from here on.
    r.initialized_flag.store(HAMI_MAGIC, Ordering::Release);
}

/// One device's numbers read together under its lock (see [`ProcessSlot::audit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAudit {
    /// The device's reservation total.
    pub total: u64,
    /// Sum of every slot's held bytes (equals `total` by the protocol's invariant).
    pub held: u64,
    /// Sum of HAMi's `used[device].total` over `[0, proc_num)` (what the monitor adds up).
    pub hami_used: u64,
}

impl DeviceAudit {
    /// Whether the three agree.
    pub fn is_consistent(&self) -> bool {
        self.total == self.held && self.held == self.hami_used
    }
}

/// This process's registration in a table: the [`UsageLedger`] the hook reserves through.
///
/// [`ProcessSlot::leave`] (at a normal exit) or dropping it deregisters (returns its usage to
/// the pool); so does process death, through the kernel-held liveness lock.
#[derive(Debug)]
pub struct ProcessSlot {
    table: UsageTable,
    index: usize,
    /// The owner word this process writes into device locks; 0 once it left the table.
    owner: AtomicU64,
    fork_epoch: u64,
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

impl Drop for ProcessSlot {
    fn drop(&mut self) {
        let _ = self.leave();
    }
}

impl UsageLedger for ProcessSlot {
    fn try_reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        let d = device.as_usize();
        let refuse = |in_use, limit| OutOfMemory {
            device,
            requested: bytes,
            in_use,
            limit,
        };
        let Some(owner) = self.owner().filter(|_| d < MAX_DEVICES) else {
            let usage = self.table.usage(device);
            return Err(refuse(usage.used, usage.limit.unwrap_or(0)));
        };
        if bytes == 0 {
            return Ok(());
        }
        let c = class_index(class);
        let mut swept = false;
        loop {
            let st = self.table.store();
            let done = match protocol::reserve(&st, self.index, owner, d, c, bytes, &NoCrash) {
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

    fn release(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        let d = device.as_usize();
        let Some(owner) = self.owner() else {
            return;
        };
        if d >= MAX_DEVICES || bytes == 0 {
            return;
        }
        let st = self.table.store();
        let _ = protocol::release(
            &st,
            self.index,
            owner,
            d,
            class_index(class),
            bytes,
            &NoCrash,
        );
    }

    fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        self.table.usage(device)
    }

    fn charge_over_limit(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        let d = device.as_usize();
        let Some(owner) = self.owner() else {
            return;
        };
        if d >= MAX_DEVICES || bytes == 0 {
            return;
        }
        let st = self.table.store();
        let _ = protocol::charge_over_limit(
            &st,
            self.index,
            owner,
            d,
            class_index(class),
            bytes,
            &NoCrash,
        );
    }
}
