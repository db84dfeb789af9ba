//! The cross-process device-memory usage table: one memory-mapped file per container
//! (`CUDA_DEVICE_MEMORY_SHARED_CACHE`) through which every process's reservations add up
//! against the container's per-device limits.
//!
//! The file keeps HAMi-core's version 1.2 layout byte for byte (so HAMi's monitor still reads
//! and writes it) and appends vgpu's own block. Reservations are atomic against the limit
//! across processes, cost O(1) in the number of processes, and survive `kill -9` at any
//! instruction: see `docs/shm-protocol.md`.
//!
//! ```no_run
//! use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
//! use vgpu_shm::{TableInit, UsageTable};
//!
//! let init = TableInit {
//!     uuids: vec!["GPU-0".into()],
//!     memory_limits: vec![Some(1 << 30)],
//!     sm_limits: vec![None],
//!     priority: 1,
//! };
//! let table = UsageTable::open_or_create("/tmp/cudevshr.cache", &init)?;
//! let me = table.register_self()?;
//! me.try_reserve(DeviceIndex(0), UsageClass::Data, 4096).expect("fits");
//! me.release(DeviceIndex(0), UsageClass::Data, 4096);
//! println!("{:?}", table.snapshot());
//! # Ok::<(), vgpu_shm::ShmError>(())
//! ```
//!
//! Layout: `layout` (the file's ABI: every byte offset, asserted at compile time), `protocol`
//! (the reservation protocol, generic over its storage so loom checks it), `table/` (an
//! attached file, [`UsageTable`], and this process's slot in it, [`ProcessSlot`]: `open`,
//! `slot`, `process`, `fields`, `snapshot`, `mapped`), `validate` (a file's contents checked
//! before anything trusts them), `file` (opening files a tenant controls), `node_read`
//! (node-side reading, [`NodeReader`]), `hami_file` (files HAMi-core itself wrote), `turns`
//! (the turn board) and `shares` (share mode's records on it), `error`, `sync` (the
//! `cfg(loom)` switch), `sys` (every system call). Feature `testing`: `fuzzing` (the attach
//! path over arbitrary bytes, for the fuzz target).
//!
//! Unsafe code lives in `sys` alone (the mapping, `flock`, OFD locks, the fork hook); the
//! compiler holds every other module to that.

#![deny(unsafe_code)]

mod error;
mod file;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
mod hami_file;
pub mod layout;
mod node_read;
mod protocol;
mod room;
pub mod shares;
mod sync;
#[allow(unsafe_code)] // the crate's one boundary module
mod sys;
mod table;
mod turns;
mod validate;

pub use error::{ImageError, ShmError};
pub use node_read::NodeReader;
pub use protocol::HostPolicy;
pub use room::{ROOM_MAX_AGE_NS, RoomBoard, RoomKind, RoomRecord, room_file_name};
pub use sys::{monotonic_coarse_secs, monotonic_ns};
pub use table::{
    DeviceAudit, DeviceSnapshot, FileLink, ProcessDeviceUsage, ProcessSlot, ProcessSnapshot,
    RECENT_KERNEL_ACTIVE, TableInit, TableSnapshot, UsageTable,
};
pub use turns::{TURN_ENTRIES, Tenant, TurnBoard, TurnBoardError, board_file_name, container_key};
pub use validate::ImageInfo;

/// Validate arbitrary file contents as a vgpu table (the attach path's checks; fuzzed).
pub fn validate_image(bytes: &[u8]) -> Result<ImageInfo, ImageError> {
    validate::validate(bytes)
}

#[cfg(all(test, not(loom)))]
mod tests;
