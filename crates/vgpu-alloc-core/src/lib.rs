#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod allocator;
pub mod backend;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
pub mod ledger;
#[cfg(any(test, feature = "testing"))]
pub mod mock;
pub mod region;
pub mod table;
pub mod tuning;

pub use allocator::{
    AddressRange, AllocError, Allocated, Allocator, AllocatorStats, ContextReleased, FreeError,
    Freed, InvalidAllocatorConfig, PendingRecord, RegionInfo,
};
pub use backend::{BackendError, ContextId, DeviceBackend, DevicePtr, MemoryInfo};
pub use ledger::{
    DeviceIndex, DeviceUsage, InMemoryLedger, MAX_DEVICES, OutOfMemory, Reservation, UsageClass,
    UsageLedger,
};
#[cfg(any(test, feature = "testing"))]
pub use mock::MockBackend;
pub use table::{AllocId, Allocation, AllocationKind, AllocationTable, Placement};
pub use tuning::AllocatorConfig;
