//! [`UsageTable`] (an attached file) and [`ProcessSlot`] (this process's registration), one
//! room per concern: `open` (the file's lifecycle: create, validate, initialize, upgrade),
//! `slot` (the administrative sections: registration and sweeping), `process` (a registered
//! process's ledger), `fields` (limits and the monitor's fields), `snapshot` (the read-only
//! picture) and `mapped` (the protocol's view of the mapping and HAMi's mirror).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vgpu_alloc_core::UsageClass;

use crate::error::ShmError;
use crate::layout::{Extension, HamiRegion, HostHeld, PublishTimes};
use crate::sys::{self, Mapping};

mod fields;
mod mapped;
mod open;
mod process;
mod slot;
mod snapshot;

pub(crate) use mapped::Mapped;
pub use open::TableInit;
pub(crate) use open::open_error;
pub use process::{DeviceAudit, ProcessSlot};
pub(crate) use snapshot::picture;
pub use snapshot::{DeviceSnapshot, ProcessDeviceUsage, ProcessSnapshot, TableSnapshot};

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

#[derive(Debug)]
pub(super) struct Inner {
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
    /// The opened file's (device, inode): what the path must still name (see `link_state`).
    identity: (u64, u64),
    /// Seconds since the epoch of this handle's last periodic sweep.
    last_periodic_sweep: std::sync::atomic::AtomicU64,
    /// The file had the host-backed class when attached (minor version ≥ 2, mapped whole):
    /// it keeps it (versions only grow), so [`UsageTable::store`] need not ask again.
    host_at_attach: bool,
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

/// What the table's path names now, compared with the file a handle attached to
/// ([`UsageTable::link_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileLink {
    /// The path still names the attached file.
    Linked,
    /// Nothing is at the path: the file was unlinked (the handle still works, alone).
    Unlinked,
    /// Another file (or a link) is at the path: the file was replaced under its name.
    Replaced,
}

/// An attached shared usage table (cheap to clone).
#[derive(Debug, Clone)]
pub struct UsageTable {
    inner: Arc<Inner>,
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
impl UsageTable {
    /// The path the table was opened at.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Whether this handle initialized the file (else it found an initialized table).
    pub fn created(&self) -> bool {
        self.inner.created
    }

    /// Whether the path still names the file this handle uses: one `lstat` of the path
    /// compared with the (device, inode) found at open (about a microsecond, no lock).
    ///
    /// A file unlinked or replaced under the same name splits a container in two ledgers:
    /// processes that attached before keep adding up in the old file, later ones in the new,
    /// and neither sees the other's usage against the limit. The hook asks this now and then
    /// (see [`FileLink`]) and re-attaches or refuses.
    pub fn link_state(&self) -> Result<FileLink, ShmError> {
        use std::os::unix::fs::MetadataExt;
        match std::fs::symlink_metadata(&self.inner.path) {
            Ok(m) if (m.dev(), m.ino()) == self.inner.identity => Ok(FileLink::Linked),
            Ok(_) => Ok(FileLink::Replaced),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FileLink::Unlinked),
            Err(source) => Err(ShmError::Io {
                path: self.inner.path.clone(),
                op: "stat",
                source,
            }),
        }
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

    /// The host-backed class, when the file has it (minor version ≥ 2 when attached).
    pub(crate) fn host_held(&self) -> Option<&HostHeld> {
        if self.ext().header.minor_version.load(Ordering::Acquire) < 2 {
            return None;
        }
        self.inner.map.host_held()
    }

    pub(crate) fn store(&self) -> Mapped<'_> {
        if self.inner.host_at_attach
            && let Some((region, ext, host)) = self.inner.map.parts()
        {
            return Mapped::new(region, ext, Some(host), &self.inner.probe_file);
        }
        Mapped::new(
            self.region(),
            self.ext(),
            self.host_held(),
            &self.inner.probe_file,
        )
    }

    pub(super) fn check_writable(&self) -> Result<&File, ShmError> {
        if sys::fork_epoch() != self.inner.fork_epoch {
            return Err(ShmError::Forked);
        }
        self.inner.lock_file.as_ref().ok_or(ShmError::ReadOnly)
    }
}
