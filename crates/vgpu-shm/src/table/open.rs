//! The file's lifecycle: create or open, validate, initialize, upgrade a minor-0 file, and
//! the separate descriptors for the kernel-held locks.
//!
//! Attaching opens the path more than once: `file::open_writable` tries `O_CREAT | O_EXCL`
//! and, finding the file there, opens it again without; the lock and probe descriptors are
//! opens of their own (separate open file descriptions, see `Inner`). Another process may
//! unlink the file in between (and maybe create the next one at once). A create-or-join that
//! finds its file gone from the path at a later open starts again from the first open, at
//! most [`OPEN_ATTEMPTS`] times in all: the file at the path now is the one to create or join,
//! and a joiner that gave up there would refuse every reservation for nothing. Every attempt
//! makes every check again.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{ImageError, ShmError};
use crate::file;
use crate::layout::{
    self, BASE_FILE_LEN, EXT_MAGIC, EXT_VERSION, Extension, FILE_LEN, HAMI_MAGIC, HAMI_MAJOR,
    HAMI_MINOR, HamiRegion, MAX_DEVICES, MAX_SLOTS, UUID_LEN,
};
use crate::protocol::HostPolicy;
use crate::sys::{self, Mapping};
use crate::validate::validate;

use super::{INIT_LOCK_TIMEOUT, Inner, SWEEP_LOCK_TIMEOUT, UsageTable, now_secs};

/// How many times a create-or-join tries in all when its file leaves the path between its
/// opens (see the module's documentation); then the last attempt's error is the answer.
const OPEN_ATTEMPTS: usize = 3;

/// Why one attempt at attaching failed.
#[derive(Debug)]
enum Failed {
    /// The file this attempt had found at the path was gone at a later open (unlinked, or
    /// unlinked and replaced): another attempt may create or join the file there now.
    Vanished(ShmError),
    /// Anything else: the answer as it is.
    Final(ShmError),
}

impl From<ShmError> for Failed {
    fn from(e: ShmError) -> Self {
        Self::Final(e)
    }
}

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

impl UsageTable {
    /// Attach to the table at `path`, creating and initializing it from `init` if it does not
    /// exist (mode 0666, whatever the umask). An existing file keeps its limits. Refused
    /// ([`ShmError::Refused`]): a symbolic link, a non-regular file, in a world-writable
    /// directory a file of another owner than the caller or root, an empty file with more
    /// than one name. Nothing but an empty file or an unfinished table of vgpu's own is ever
    /// initialized (docs/security.md, "Files vgpu writes into"). A file unlinked (or replaced)
    /// between this call's opens of the path is let go, and the call starts again with the
    /// file at the path now, three attempts at most.
    pub fn open_or_create(path: impl AsRef<Path>, init: &TableInit) -> Result<Self, ShmError> {
        Self::open_or_create_with_host_policy(path, init, HostPolicy::default())
    }

    /// [`Self::open_or_create`], with `host` as every device's host policy of a file this
    /// call creates, written with the rest of the initialization (so no process ever sees
    /// the file without it). An existing file keeps its policy, as it keeps its limits.
    pub fn open_or_create_with_host_policy(
        path: impl AsRef<Path>,
        init: &TableInit,
        host: HostPolicy,
    ) -> Result<Self, ShmError> {
        init.check()?;
        Self::open(path.as_ref(), Some((init, host)), true)
    }

    /// Attach read-write to an existing table.
    pub fn open_existing(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        Self::open(path.as_ref(), None, true)
    }

    /// Attach read-only (inspection inside the container; no sweeping, no writes). The file is
    /// mapped, so a truncation faults the reader: node-side readers use
    /// [`NodeReader`](crate::NodeReader) instead.
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        Self::open(path.as_ref(), None, false)
    }

    fn open(
        path: &Path,
        init: Option<(&TableInit, HostPolicy)>,
        writable: bool,
    ) -> Result<Self, ShmError> {
        // Only a create-or-join starts again: without create, a file gone is the answer.
        let mut attempt = 1;
        loop {
            match Self::attach(path, init, writable) {
                Ok(table) => return Ok(table),
                Err(Failed::Vanished(_)) if init.is_some() && attempt < OPEN_ATTEMPTS => {
                    attempt += 1;
                }
                Err(Failed::Vanished(e) | Failed::Final(e)) => return Err(e),
            }
        }
    }

    /// One attempt of [`Self::open`].
    fn attach(
        path: &Path,
        init: Option<(&TableInit, HostPolicy)>,
        writable: bool,
    ) -> Result<Self, Failed> {
        let io = |op: &'static str| {
            let path = path.to_path_buf();
            move |source: io::Error| ShmError::Io { path, op, source }
        };
        let invalid = |source: ImageError| ShmError::InvalidFile {
            path: path.to_path_buf(),
            source,
        };
        let opened = if writable {
            file::open_writable(path, init.is_some())
        } else {
            file::open_read_only(path)
        }
        // With create, the plain open runs only after `O_EXCL` found the file there.
        .map_err(|e| open_failed(path, e, writable && init.is_some()))?;
        if writable && !opened.created {
            file::check_owner(path, &opened.meta).map_err(|e| open_error(path, e))?;
        }
        let (file, meta) = (opened.file, opened.meta);

        // Initialization (and the check that it is finished) happen under flock.
        let guard = sys::flock_exclusive_within(&file, INIT_LOCK_TIMEOUT, Duration::from_millis(1))
            .map_err(io("flock"))?
            .ok_or_else(|| ShmError::InitLockTimeout {
                path: path.to_path_buf(),
            })?;
        let len = file.metadata().map_err(io("fstat"))?.len();
        let mut created = false;
        let map = match init {
            // Empty: this open created it, or nobody ever wrote a byte into it (an operator
            // made it beforehand with the mode they want, or its creator died at once). One
            // with other names (a hard link) may be somebody's file: left alone.
            Some(init) if len == 0 => {
                if !opened.created && meta.nlink() != 1 {
                    return Err(ShmError::Refused {
                        path: path.to_path_buf(),
                        reason: format!(
                            "is an empty file with {} names that vgpu did not create (left \
                             as it is)",
                            meta.nlink()
                        ),
                    }
                    .into());
                }
                created = true;
                Self::initialize(&file, init, false).map_err(io("initialize"))?
            }
            _ => {
                let map_len = usize::try_from(len.min(FILE_LEN as u64)).unwrap_or(FILE_LEN);
                let map = Mapping::map(&file, map_len.max(1), writable).map_err(io("mmap"))?;
                // Report the real length, not the mapped one.
                match validate(&map) {
                    Ok(info) if info.minor_version < layout::EXT_MINOR && writable => {
                        // Written by an older library: append the parts it lacks.
                        drop(map);
                        Self::upgrade(&file, len, info.minor_version).map_err(io("upgrade"))?
                    }
                    Ok(_) if len >= BASE_FILE_LEN as u64 => map,
                    Ok(_) => unreachable_truncated(len).map_err(invalid)?,
                    // Only an initialization of vgpu's that died leaves its magic without
                    // HAMi's: this file is vgpu's own, and nobody is attached to it.
                    Err(ImageError::Uninitialized) if carries_ext_magic(&map) => {
                        let Some(init) = init else {
                            return Err(invalid(ImageError::Uninitialized).into());
                        };
                        drop(map);
                        created = true;
                        Self::initialize(&file, init, true).map_err(io("initialize"))?
                    }
                    Err(ImageError::Truncated { .. }) => {
                        unreachable_truncated(len).map_err(invalid)?
                    }
                    Err(e) => return Err(invalid(e).into()),
                }
            }
        };
        drop(guard);
        #[cfg(test)]
        between_opens(path);

        // Separate open file descriptions of the same inode for the OFD locks (see `Inner`).
        // Not found, or another file: the one opened above left the path meanwhile.
        let reopen = |write: bool| -> Result<File, Failed> {
            let f = if write {
                file::open_writable(path, false)
            } else {
                file::open_read_only(path)
            }
            .map_err(|e| open_failed(path, e, true))?
            .file;
            let m = f.metadata().map_err(io("fstat"))?;
            if (m.dev(), m.ino()) != (meta.dev(), meta.ino()) {
                return Err(Failed::Vanished(io("reopen")(io::Error::other(
                    "file was replaced while opening",
                ))));
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
        let host_at_attach = map
            .parts()
            .is_some_and(|(_, ext, _)| ext.header.minor_version.load(Ordering::Acquire) >= 2);
        let table = Self {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                map,
                lock_file,
                probe_file,
                admin: Mutex::new(()),
                fork_epoch: sys::fork_epoch(),
                created,
                identity: (meta.dev(), meta.ino()),
                last_periodic_sweep: std::sync::atomic::AtomicU64::new(now_secs()),
                host_at_attach,
            }),
        };
        if writable {
            // Attaching is one of the moments dead processes' usage returns to the pool.
            let _ = table.sweep_with_timeout(SWEEP_LOCK_TIMEOUT);
        }
        Ok(table)
    }

    /// Append the parts a valid file of an older minor version lacks (the publish-time table
    /// after minor 0, the host-backed class after minor 1, the refusal counts after minor 2,
    /// the swap words after minor 3, the kept host bytes after minor 4; caller holds the init
    /// flock).
    /// Everything before them stays as it is, so processes of older libraries that map only
    /// what they know keep working; they never read the new parts.
    fn upgrade(file: &File, len: u64, minor: u32) -> io::Result<Mapping> {
        // Growing zero-fills; a longer file is never cut.
        if len < FILE_LEN as u64 {
            file.set_len(FILE_LEN as u64)?;
        }
        let map = Mapping::map(file, FILE_LEN, true)?;
        let (Some(ext), Some(times), Some(host)) =
            (map.extension(), map.publish_times(), map.host_held())
        else {
            return Err(io::Error::other("mapping shorter than the table"));
        };
        // Whatever lay beyond the parts the minor version names belongs to nobody yet.
        if minor < 1 {
            for slot in &times.slots {
                slot.ident.store(0, Ordering::Relaxed);
                for at in &slot.sm_util_at {
                    at.store(0, Ordering::Relaxed);
                }
            }
        }
        if minor < 2 {
            for words in host.slots.iter().flatten() {
                words.store(0, Ordering::Relaxed);
            }
            // Padding before minor 2: zero in files vgpu wrote, but say so rather than
            // assume. No host byte is held yet, and no process of this file can reserve one
            // before the minor version below is published.
            for d in &ext.devices {
                for w in [&d.host_total, &d.host_spill, &d.host_flags] {
                    w.store(0, Ordering::Relaxed);
                }
            }
        }
        // Padding before minor 3: older libraries counted no refusal. (From minor 3 on the
        // words are counts, which an upgrade keeps.)
        if minor < 3 {
            for d in &ext.devices {
                d.oom_refusals.store(0, Ordering::Relaxed);
            }
        }
        // Padding before minor 4: nobody asked for a swap-out; no slot is swapped out.
        if minor < 4 {
            ext.header.swap_requests.store(0, Ordering::Relaxed);
            for slot in &ext.slots {
                slot.swapped_out.store(0, Ordering::Relaxed);
            }
        }
        // Padding before minor 5: a stamp of 0 names no slot's process (live idents carry
        // state 1), so the processes already in the file are shown as not saying what they
        // keep, which is true of their libraries.
        if minor < 5 {
            for slot in &ext.slots {
                slot.kept_ident.store(0, Ordering::Relaxed);
                slot.kept_host.store(0, Ordering::Relaxed);
            }
        }
        ext.header
            .minor_version
            .store(layout::EXT_MINOR, Ordering::Release);
        Ok(map)
    }

    /// Size the file and write a fresh table (caller holds the init flock). The file is
    /// empty, or (`unfinished`) vgpu's own whose initializer died: cutting that one to 0 first
    /// zero-fills what it left. Nothing else is ever cut.
    fn initialize(
        file: &File,
        (init, host): (&TableInit, HostPolicy),
        unfinished: bool,
    ) -> io::Result<Mapping> {
        if unfinished {
            file.set_len(0)?;
        }
        file.set_len(FILE_LEN as u64)?;
        let map = Mapping::map(file, FILE_LEN, true)?;
        let (Some(region), Some(ext)) = (map.region(), map.extension()) else {
            return Err(io::Error::other("mapping shorter than the table"));
        };
        write_fresh(region, ext, init, host);
        Ok(map)
    }
}

/// Tests only: what runs between an attempt's first open and its reopens.
#[cfg(test)]
type Hook = Box<dyn FnMut(&Path)>;

#[cfg(test)]
thread_local! {
    /// Tests only: run on this thread between an attempt's first open of the path and its
    /// reopens, where another process may unlink or replace the file.
    static BETWEEN_OPENS: std::cell::RefCell<Option<Hook>> =
        const { std::cell::RefCell::new(None) };
}

#[cfg(test)]
fn between_opens(path: &Path) {
    // Taken out while it runs: it may open a table itself (as another process would).
    if let Some(mut hook) = BETWEEN_OPENS.take() {
        hook(path);
        BETWEEN_OPENS.with_borrow_mut(|slot| {
            slot.get_or_insert(hook);
        });
    }
}

/// A failed open of the path as an attempt's failure. `found` says this attempt had found a
/// file at the path before: the open's not finding one then means it was unlinked meanwhile.
/// (Not found at `create`, with `O_CREAT`, is a missing directory: an error as it is.)
fn open_failed(path: &Path, e: file::OpenError, found: bool) -> Failed {
    let gone = found
        && matches!(&e, file::OpenError::Io("open", source)
            if source.kind() == io::ErrorKind::NotFound);
    let e = open_error(path, e);
    if gone {
        Failed::Vanished(e)
    } else {
        Failed::Final(e)
    }
}

/// A [`file`](mod@crate::file) refusal or failure as the table's error.
pub(crate) fn open_error(path: &Path, e: file::OpenError) -> ShmError {
    let path = path.to_path_buf();
    match e {
        file::OpenError::Io(op, source) => ShmError::Io { path, op, source },
        file::OpenError::Refused(reason) => ShmError::Refused { path, reason },
    }
}

/// Whether vgpu's extension magic is in place (written first by an initializer).
fn carries_ext_magic(map: &Mapping) -> bool {
    map.load_u64(layout::offsets::EXT_MAGIC) == Some(EXT_MAGIC)
}

fn unreachable_truncated(len: u64) -> Result<Mapping, ImageError> {
    Err(ImageError::Truncated {
        len,
        expected: FILE_LEN as u64,
    })
}

fn write_fresh(region: &HamiRegion, ext: &Extension, init: &TableInit, host: HostPolicy) {
    // First: from here on the file is recognizably vgpu's, so that if this initializer dies,
    // the next one may start again (see `open`).
    ext.header.magic.store(EXT_MAGIC, Ordering::Relaxed);
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
    for d in &ext.devices {
        super::fields::store_host_policy(d, host, Ordering::Relaxed);
    }
    let h = &ext.header;
    h.version.store(EXT_VERSION, Ordering::Relaxed);
    h.ext_size
        .store(size_of::<Extension>() as u32, Ordering::Relaxed);
    h.max_slots.store(MAX_SLOTS as u32, Ordering::Relaxed);
    h.max_devices.store(MAX_DEVICES as u32, Ordering::Relaxed);
    h.admin_epoch.store(1, Ordering::Relaxed);
    h.created_at.store(now_secs(), Ordering::Relaxed);
    h.minor_version.store(layout::EXT_MINOR, Ordering::Relaxed);
    // Last: the monitor and other processes treat the file as initialized from here on.
    r.initialized_flag.store(HAMI_MAGIC, Ordering::Release);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::FileLink;
    use crate::tests::TempPath;
    use std::cell::Cell;
    use std::rc::Rc;

    fn init() -> TableInit {
        TableInit {
            uuids: vec!["GPU-race".into()],
            memory_limits: vec![Some(1 << 20)],
            sm_limits: vec![None],
            priority: 1,
        }
    }

    /// Runs `f` with `hook` between the first open and the reopens of every attempt on this
    /// thread; answers `f`'s result and how many times the hook ran (one per attempt).
    fn with_hook<T>(
        mut hook: impl FnMut(&Path, usize) + 'static,
        f: impl FnOnce() -> T,
    ) -> (T, usize) {
        let calls = Rc::new(Cell::new(0));
        let counted = Rc::clone(&calls);
        BETWEEN_OPENS.set(Some(Box::new(move |path: &Path| {
            counted.set(counted.get() + 1);
            hook(path, counted.get());
        })));
        let out = f();
        BETWEEN_OPENS.set(None);
        (out, calls.get())
    }

    #[test]
    fn a_joiner_whose_file_is_unlinked_between_its_opens_tries_again() {
        let p = TempPath::new("open-race-unlink");
        let first = UsageTable::open_or_create(&p.0, &init()).unwrap();
        // Another process removes the file after this one opened it, before it reopens it.
        let (joined, calls) = with_hook(
            |path, call| {
                if call == 1 {
                    std::fs::remove_file(path).unwrap();
                }
            },
            || UsageTable::open_or_create(&p.0, &init()),
        );
        let joined = joined.expect("a create-or-join that lost its file tries again");
        assert_eq!(calls, 2, "one more attempt, no more");
        // It created the file that is at the path now, and uses it.
        assert!(joined.created());
        assert_eq!(joined.link_state().unwrap(), FileLink::Linked);
        // The handle that attached before sees its file gone from the path (split ledgers,
        // as link_state documents), not this one.
        assert_eq!(first.link_state().unwrap(), FileLink::Replaced);
        assert_eq!(
            joined.snapshot().devices[0].limit,
            Some(1 << 20),
            "initialized like any new file"
        );
    }

    #[test]
    fn a_joiner_whose_file_is_replaced_between_its_opens_joins_the_new_one() {
        let p = TempPath::new("open-race-replace");
        drop(UsageTable::open_or_create(&p.0, &init()).unwrap());
        let (joined, calls) = with_hook(
            |path, call| {
                if call == 1 {
                    // Unlinked, and at once another process creates the next file.
                    std::fs::remove_file(path).unwrap();
                    let newer = UsageTable::open_or_create(path, &init()).unwrap();
                    assert!(newer.created());
                }
            },
            || UsageTable::open_or_create(&p.0, &init()),
        );
        let joined = joined.expect("joins the file now at the path");
        assert_eq!(calls, 2);
        assert!(!joined.created(), "joined the other process's file");
        assert_eq!(joined.link_state().unwrap(), FileLink::Linked);
    }

    #[test]
    fn a_file_that_keeps_vanishing_is_an_error_after_three_attempts() {
        let p = TempPath::new("open-race-always");
        let (out, calls) = with_hook(
            |path, _| std::fs::remove_file(path).unwrap(),
            || UsageTable::open_or_create(&p.0, &init()),
        );
        assert_eq!(calls, 3, "bounded: three attempts");
        match out {
            Err(ShmError::Io {
                op: "open", source, ..
            }) => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn attaching_without_create_does_not_try_again() {
        let p = TempPath::new("open-race-existing");
        drop(UsageTable::open_or_create(&p.0, &init()).unwrap());
        let (out, calls) = with_hook(
            |path, _| std::fs::remove_file(path).unwrap(),
            || UsageTable::open_existing(&p.0),
        );
        assert_eq!(calls, 1);
        assert!(matches!(
            out,
            Err(ShmError::Io { op: "open", ref source, .. }) if source.kind() == io::ErrorKind::NotFound
        ));
        // Nothing at the path, no create: a clear error at once.
        let (out, calls) = with_hook(|_, _| {}, || UsageTable::open_existing(&p.0));
        assert_eq!(calls, 0);
        assert!(matches!(out, Err(ShmError::Io { op: "open", .. })));
    }

    #[test]
    fn a_missing_directory_is_an_error_at_once() {
        let p = TempPath::new("open-race-nodir");
        let path = p.0.with_extension("missing").join("table.cache");
        let (out, calls) = with_hook(|_, _| {}, || UsageTable::open_or_create(&path, &init()));
        assert_eq!(calls, 0);
        assert!(matches!(
            out,
            Err(ShmError::Io { op: "create", ref source, .. }) if source.kind() == io::ErrorKind::NotFound
        ));
    }
}
