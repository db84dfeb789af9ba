//! The device behind the allocator: a strategy trait over the driver's raw
//! allocate/free/memory-info. The hook implements it over the CUDA driver; an in-memory
//! device for tests is `MockBackend` (feature `testing`).

use std::fmt;

use crate::ledger::DeviceIndex;

/// A device virtual address (`CUdeviceptr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(pub u64);

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A driver context (`CUcontext` as an integer). Regions and allocations belong to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContextId(pub u64);

/// A driver call that failed: the raw `CUresult` code, so the hook can return it as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("device backend error (CUresult {code})")]
pub struct BackendError {
    /// The driver's status code (`CUresult`, never 0).
    pub code: u32,
}

impl BackendError {
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: Self = Self { code: 1 };
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: Self = Self { code: 2 };
}

/// Free and total physical bytes of one device, as `cuMemGetInfo` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryInfo {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// Raw device memory operations (the real driver in the hook, `MockBackend` in tests).
///
/// Implementations must be cheap to call concurrently; the allocator never holds its
/// own lock while calling them.
pub trait DeviceBackend: Send + Sync {
    /// Allocate `bytes` on `device` in `context` (`cuMemAlloc` with `context` current).
    fn allocate(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u64,
    ) -> Result<DevicePtr, BackendError>;
    /// Free an allocation made by [`DeviceBackend::allocate`] (`cuMemFree`).
    fn free(
        &self,
        device: DeviceIndex,
        context: ContextId,
        ptr: DevicePtr,
    ) -> Result<(), BackendError>;
    /// Physical free/total memory of `device` (`cuMemGetInfo`).
    fn memory_info(&self, device: DeviceIndex) -> Result<MemoryInfo, BackendError>;
}
