//! Node-side reading: `vgpu status`, `watch` and the exporter read every container's usage
//! file and the node-wide turn boards, all of which tenants can write.
//!
//! Invariant: nothing a tenant does to those files can crash or hang a [`NodeReader`]. It
//! never maps a file (a mapped page past the end of a file truncated meanwhile raises SIGBUS
//! in the reader); it opens with `O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC` and reads
//! only regular files (a FIFO would block `open` forever; a link could point anywhere); it
//! copies the file with `pread` and validates and decodes the copy exactly as an attached
//! table is (`validate`, then the same snapshot code over the same `layout` structs); and it
//! gives each read a deadline, after which it answers [`ShmError::TimedOut`] (a hung file
//! system: the reading thread is left to finish on its own). It never writes.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::{ImageError, ShmError};
use crate::file;
use crate::layout::{BASE_FILE_LEN, FILE_LEN};
use crate::sys::OwnedImage;
use crate::table::{Mapped, TableSnapshot, open_error, picture};
use crate::turns::{Tenant, TurnBoardError, read_tenants};
use crate::validate::validate;

/// Reads usage files and turn boards that tenants control, each read bounded in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeReader {
    timeout: Duration,
}

impl Default for NodeReader {
    fn default() -> Self {
        Self::new(Self::DEFAULT_TIMEOUT)
    }
}

impl NodeReader {
    /// What [`NodeReader::default`] allows one read: a 2.8 MB local file takes about a
    /// millisecond.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

    /// A reader that gives each read at most `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }

    /// The usage file at `path`: a vgpu table, or a file HAMi-core itself wrote (decoded from
    /// its region, as [`TableSnapshot::read_hami_core_file`] does). Liveness is asked of the
    /// kernel's locks as for an attached table. Errors: [`ShmError::Refused`] (a symbolic
    /// link, a FIFO, any other non-regular file), [`ShmError::InvalidFile`] (including a file
    /// cut short while it was read), [`ShmError::Io`], [`ShmError::TimedOut`].
    pub fn table(&self, path: impl AsRef<Path>) -> Result<TableSnapshot, ShmError> {
        let path = path.as_ref().to_path_buf();
        let p = path.clone();
        bounded(self.timeout, move || read_table(&p)).unwrap_or(Err(ShmError::TimedOut {
            path,
            after: self.timeout,
        }))
    }

    /// The tenants announced on the turn board at `path` whose heartbeat is at most `max_age`
    /// old at `now` (`CLOCK_MONOTONIC` ns, see [`crate::monotonic_ns`]), idle ones (limit 0,
    /// [`Tenant::takes_turns`]) included. Errors as for
    /// [`NodeReader::table`], in the board's terms; a timeout is [`TurnBoardError::Busy`].
    pub fn turn_tenants(
        &self,
        path: impl AsRef<Path>,
        now: u64,
        max_age: u64,
    ) -> Result<Vec<Tenant>, TurnBoardError> {
        let path: PathBuf = path.as_ref().to_path_buf();
        bounded(self.timeout, move || read_tenants(&path, now, max_age))
            .unwrap_or(Err(TurnBoardError::Busy))
    }
}

impl NodeReader {
    /// The share-mode records on the turn board at `path` (docs/sm-limit.md, `shares.rs`),
    /// as [`NodeReader::turn_tenants`] reads the tenants.
    pub fn share_records(
        &self,
        path: impl AsRef<Path>,
    ) -> Result<Vec<crate::shares::ShareRecord>, TurnBoardError> {
        let path: PathBuf = path.as_ref().to_path_buf();
        bounded(self.timeout, move || {
            crate::shares::read_share_records(&path)
        })
        .unwrap_or(Err(TurnBoardError::Busy))
    }
}

/// `f` on a thread of its own, if it returns within `timeout`; run here when no thread can be
/// started (the opens cannot block, so only a hung file system could then hold it).
fn bounded<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let f = std::sync::Arc::new(std::sync::Mutex::new(Some(f)));
    let in_thread = f.clone();
    let spawned = std::thread::Builder::new()
        .name("vgpu-node-read".into())
        .spawn(move || {
            let job = in_thread.lock().ok().and_then(|mut g| g.take());
            if let Some(job) = job {
                let _ = tx.send(job());
            }
        });
    if spawned.is_err() {
        let job = f.lock().ok().and_then(|mut g| g.take())?;
        return Some(job());
    }
    rx.recv_timeout(timeout).ok()
}

fn read_table(path: &Path) -> Result<TableSnapshot, ShmError> {
    let opened = file::open_read_only(path).map_err(|e| open_error(path, e))?;
    let image = OwnedImage::read(&opened.file, FILE_LEN).map_err(|source| ShmError::Io {
        path: path.to_path_buf(),
        op: "read",
        source,
    })?;
    let invalid = |source| ShmError::InvalidFile {
        path: path.to_path_buf(),
        source,
    };
    let len = image.bytes().len();
    match validate(image.bytes()) {
        Ok(_) if len >= BASE_FILE_LEN => {
            let (Some(region), Some(ext)) = (image.region(), image.extension()) else {
                return Err(invalid(truncated(len)));
            };
            let times = image
                .publish_times()
                .filter(|_| ext.header.minor_version.load(Ordering::Acquire) >= 1);
            let minor = ext.header.minor_version.load(Ordering::Acquire);
            let host = image.host_held().filter(|_| minor >= 2);
            Ok(picture(
                &Mapped::new(region, ext, host, &opened.file),
                times,
            ))
        }
        Ok(_) => Err(invalid(truncated(len))),
        Err(ImageError::HamiCoreFile) => {
            TableSnapshot::from_hami_core_image(image.bytes()).map_err(invalid)
        }
        Err(e) => Err(invalid(e)),
    }
}

fn truncated(len: usize) -> ImageError {
    ImageError::Truncated {
        len: len as u64,
        expected: FILE_LEN as u64,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::tests::TempPath;
    use crate::{TableInit, UsageTable};
    use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};

    fn init() -> TableInit {
        TableInit {
            uuids: vec!["GPU-node".into()],
            memory_limits: vec![Some(1000)],
            sm_limits: vec![Some(40)],
            priority: 1,
        }
    }

    fn mkfifo(path: &Path) {
        let ok = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mkfifo {}", path.display());
    }

    #[test]
    fn reads_what_an_attached_snapshot_reads() {
        let p = TempPath::new("node-same");
        let t = UsageTable::open_or_create(&p.0, &init()).unwrap();
        let me = t.register_self().unwrap();
        me.try_reserve(DeviceIndex(0), UsageClass::Data, 300)
            .unwrap();
        me.publish_sm_util(DeviceIndex(0), 12, 777);
        let read = NodeReader::default().table(&p.0).unwrap();
        assert_eq!(read, UsageTable::open_read_only(&p.0).unwrap().snapshot());
        assert_eq!(read.devices[0].used, 300);
        assert_eq!(read.processes[0].devices[0].sm_util_at, Some(777));
        assert!(read.processes[0].alive, "liveness from the kernel's locks");
        // A HAMi-core file decodes as read_hami_core_file does.
        let h = TempPath::new("node-hami");
        std::fs::write(&h.0, read.to_hami_core_image()).unwrap();
        assert_eq!(
            NodeReader::default().table(&h.0).unwrap(),
            TableSnapshot::read_hami_core_file(&h.0).unwrap()
        );
    }

    #[test]
    fn fifos_links_and_bad_files_are_errors_in_bounded_time() {
        let fifo = TempPath::new("node-fifo");
        mkfifo(&fifo.0);
        let reader = NodeReader::new(Duration::from_secs(5));
        let t0 = std::time::Instant::now();
        match reader.table(&fifo.0) {
            Err(ShmError::Refused { reason, .. }) => assert!(reason.contains("FIFO"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            reader.turn_tenants(&fifo.0, 0, 1),
            Err(TurnBoardError::Refused { .. })
        ));
        assert!(t0.elapsed() < Duration::from_secs(5));
        let real = TempPath::new("node-real");
        drop(UsageTable::open_or_create(&real.0, &init()).unwrap());
        let link = TempPath::new("node-link");
        std::os::unix::fs::symlink(&real.0, &link.0).unwrap();
        assert!(matches!(
            reader.table(&link.0),
            Err(ShmError::Refused { reason, .. }) if reason.contains("symbolic link")
        ));
        let short = TempPath::new("node-short");
        std::fs::write(
            &short.0,
            &std::fs::read(&real.0).unwrap()[..BASE_FILE_LEN - 8],
        )
        .unwrap();
        assert!(matches!(
            reader.table(&short.0),
            Err(ShmError::InvalidFile {
                source: ImageError::Truncated { .. },
                ..
            })
        ));
    }

    #[test]
    fn a_read_that_does_not_finish_in_time_is_an_error() {
        let slow = bounded(Duration::from_millis(20), || {
            std::thread::sleep(Duration::from_millis(500));
        });
        assert_eq!(slow, None);
        assert_eq!(bounded(Duration::from_secs(5), || 7), Some(7));
    }
}
