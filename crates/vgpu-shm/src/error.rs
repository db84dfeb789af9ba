//! Errors of the shared table.

use std::io;
use std::path::PathBuf;

/// Why a file's contents are not a usable vgpu table (see [`crate::validate_image`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// Shorter than a vgpu table.
    #[error("file is {len} bytes, a vgpu table is {expected} bytes (truncated or not a table)")]
    Truncated {
        /// Actual length.
        len: u64,
        /// Expected length.
        expected: u64,
    },
    /// Shorter than HAMi-core's region (reading a file written by HAMi-core).
    #[error(
        "file is {len} bytes, shorter than a HAMi-core 1.2 region ({} bytes)",
        crate::layout::REGION_SIZE
    )]
    ShortHamiRegion {
        /// Actual length.
        len: u64,
    },
    /// Zero where the table begins, at a table's length: not a table, or an older library's
    /// initializer died. Left as it is (vgpu re-initializes only a file that carries its own
    /// magic, i.e. one it began to initialize itself).
    #[error(
        "file is not initialized (zero where a table begins); it is left as it is: delete it \
         if no process uses it"
    )]
    Uninitialized,
    /// Not a HAMi-core shared region at all.
    #[error("not a vgpu/HAMi shared region (initialized_flag {flag:#x})")]
    Foreign {
        /// The value found at offset 0.
        flag: u32,
    },
    /// A HAMi region of another layout version.
    #[error("HAMi region version {major}.{minor} is not supported (expected 1.2)")]
    UnsupportedHamiVersion {
        /// Major version found.
        major: u32,
        /// Minor version found.
        minor: u32,
    },
    /// Written by HAMi-core's own library: no vgpu extension; delete the file to switch.
    #[error("file was created by HAMi-core (no vgpu extension); stop its users and delete it")]
    HamiCoreFile,
    /// A newer vgpu wrote it.
    #[error("vgpu table version {found} is newer than this library's {supported}; upgrade")]
    NewerVersion {
        /// Version in the file.
        found: u32,
        /// Version this library writes.
        supported: u32,
    },
    /// An older, unsupported vgpu format.
    #[error("vgpu table version {found} is not supported (this library reads {supported})")]
    OlderVersion {
        /// Version in the file.
        found: u32,
        /// Version this library writes.
        supported: u32,
    },
    /// A header field has an impossible value.
    #[error("corrupt table: {field} = {value}")]
    Corrupt {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

/// Errors of [`crate::UsageTable`] and [`crate::ProcessSlot`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call on the file failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The table's path.
        path: PathBuf,
        /// What was attempted.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The file's contents are not a usable table.
    #[error("{path}: {source}")]
    InvalidFile {
        /// The table's path.
        path: PathBuf,
        /// Why.
        source: ImageError,
    },
    /// The file is not one vgpu may use there (a symbolic link, a FIFO or other non-regular
    /// file, a foreign owner in a world-writable directory, an empty file with other names).
    #[error("{path} {reason}")]
    Refused {
        /// The path.
        path: PathBuf,
        /// Why, in words.
        reason: String,
    },
    /// A node-side read did not finish in time (a hung file system); nothing was returned.
    #[error("{path}: not read within {after:?}")]
    TimedOut {
        /// The path.
        path: PathBuf,
        /// The time allowed.
        after: std::time::Duration,
    },
    /// Another process held the initialization lock too long (stopped while initializing?).
    #[error("{path}: timed out waiting for the initialization lock")]
    InitLockTimeout {
        /// The table's path.
        path: PathBuf,
    },
    /// Another process held the administrative lock too long.
    #[error("{path}: timed out waiting for the administrative lock")]
    AdminLockTimeout {
        /// The table's path.
        path: PathBuf,
    },
    /// Leaving the table timed out: a device lock stayed held by a live owner (for instance
    /// by the leaving thread itself, interrupted inside a reservation). The slot stays
    /// registered; the process's death gives it back.
    #[error("{path}: timed out leaving the table (a device lock stayed held)")]
    LeaveTimeout {
        /// The table's path.
        path: PathBuf,
    },
    /// All 1,024 process slots are taken by live processes.
    #[error("{path}: all {slots} process slots are in use by live processes")]
    TableFull {
        /// The table's path.
        path: PathBuf,
        /// Slot count.
        slots: usize,
    },
    /// The table was opened read-only.
    #[error("the table was opened read-only")]
    ReadOnly,
    /// The handle was opened before a fork; the child must open the table again.
    #[error("table handle inherited across fork(); open the table again in the child")]
    Forked,
    /// A device index out of range.
    #[error("device {device} is out of range (max {max})")]
    InvalidDevice {
        /// The index given.
        device: u32,
        /// The number of devices the file supports.
        max: usize,
    },
    /// A value out of range.
    #[error("invalid {what}: {value}")]
    InvalidValue {
        /// What it is.
        what: &'static str,
        /// The value given.
        value: String,
    },
}
