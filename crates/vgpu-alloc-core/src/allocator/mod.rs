//! The decision the hook asks for on every allocation: sub-allocate or go direct,
//! reserve in the ledger, call the device, record; and the reverse on free.
//!
//! Locking: one mutex guards the table and the regions; it is never held across a
//! device call (driver calls can take milliseconds) and only briefly across ledger
//! calls (atomic updates). Ledger bytes are always reserved *before* the device is
//! asked and released only *after* the device freed them, so concurrent processes can
//! never together exceed a limit.

use std::sync::{Mutex, MutexGuard};

mod context;
mod direct;
mod inspect;
mod state;
mod suballoc;

pub use direct::PendingRecord;
use state::State;

use crate::backend::{BackendError, ContextId, DeviceBackend, DevicePtr};
use crate::ledger::{DeviceIndex, DeviceUsage, OutOfMemory, Reservation, UsageClass, UsageLedger};
use crate::table::{Allocation, AllocationKind};
use crate::tuning::AllocatorConfig;

/// Why an allocation (or a reservation for one) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Size 0, a device the ledger does not account for ([`UsageLedger::has_device`]), or
    /// a kind the call cannot take; the hook answers `CUDA_ERROR_INVALID_VALUE` as the
    /// driver does.
    #[error("invalid value: {0}")]
    InvalidValue(&'static str),
    /// The size cannot be rounded up to the alignment in 64 bits; the hook answers
    /// `CUDA_ERROR_OUT_OF_MEMORY`, as the driver does for absurd sizes.
    #[error("a request of {requested} bytes cannot be accounted in 64 bits")]
    SizeOverflow {
        /// Bytes asked for.
        requested: u64,
    },
    /// The limit refuses it; the one line users see.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    /// The device refused it; the hook returns this code.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The allocator's own bookkeeping is inconsistent (a bug); nothing was allocated.
    #[error("internal allocator error: {0}")]
    Internal(&'static str),
}

/// Why a free could not be done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    /// Nothing tracked under that key: the hook passes the call through to the driver.
    #[error("not tracked")]
    NotTracked,
    /// The device refused to free it; the entry stays tracked and charged.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The allocator's own bookkeeping is inconsistent (a bug).
    #[error("internal allocator error: {0}")]
    Internal(&'static str),
}

/// A successful [`Allocator::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    /// The address for the program.
    pub ptr: DevicePtr,
    /// [`AllocationKind::SubAllocated`] or [`AllocationKind::Direct`].
    pub kind: AllocationKind,
    /// Bytes charged: whole chunks for a sub-allocation (its region was charged when it
    /// was created), the size rounded up to ALIGN for a direct one.
    pub accounted: u64,
}

/// What a free or release removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// The removed entry.
    pub allocation: Allocation,
    /// Bytes given back to the ledger by this call (a direct allocation's accounted
    /// size, a whole region when its last chunk went, or 0).
    pub released: u64,
}

/// Address range of the allocation containing an address (`cuMemGetAddressRange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRange {
    /// First byte of the allocation.
    pub base: DevicePtr,
    /// Its size as requested.
    pub size: u64,
    /// What made it.
    pub kind: AllocationKind,
    /// Its device.
    pub device: DeviceIndex,
    /// Its context.
    pub context: ContextId,
}

/// What [`Allocator::release_context`] dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ContextReleased {
    /// Table entries removed.
    pub allocations: usize,
    /// Regions dropped.
    pub regions: usize,
    /// Bytes given back to the ledger.
    pub released: u64,
}

/// One region as [`Allocator::regions`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its device.
    pub device: DeviceIndex,
    /// The context it serves.
    pub context: ContextId,
    /// Its first byte.
    pub base: DevicePtr,
    /// Chunks in it.
    pub chunks: u32,
    /// Chunks not in use.
    pub free_chunks: u32,
}

/// Counters for tests, logs and `vgpu` status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllocatorStats {
    /// Live table entries.
    pub live_allocations: usize,
    /// Regions held (all devices and contexts).
    pub regions: usize,
    /// Of those, regions with no chunk in use (kept warm).
    pub empty_regions: usize,
    /// Entries replaced because the driver handed out their key again (their free
    /// went around the table).
    pub stale_replaced: u64,
    /// Region frees the device refused (the region stayed charged).
    pub region_free_failures: u64,
}

/// The allocator of one process: regions, table and decisions over a device backend
/// and a usage ledger. `Send + Sync`; share it behind a `static` or an `Arc`.
#[derive(Debug)]
pub struct Allocator<B: DeviceBackend, L: UsageLedger> {
    backend: B,
    ledger: L,
    config: AllocatorConfig,
    chunk_shift: u32,
    /// Chunks of the longest possible sub-allocation.
    max_run_chunks: u32,
    state: Mutex<State>,
}

/// Allocator sizes that do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid allocator configuration: {0}")]
pub struct InvalidAllocatorConfig(pub String);

impl<B: DeviceBackend, L: UsageLedger> Allocator<B, L> {
    /// An allocator with `config`'s sizes over `backend`, charging `ledger`.
    pub fn new(
        config: AllocatorConfig,
        backend: B,
        ledger: L,
    ) -> Result<Self, InvalidAllocatorConfig> {
        config.validate().map_err(InvalidAllocatorConfig)?;
        Ok(Self {
            backend,
            ledger,
            chunk_shift: config.chunk_size.trailing_zeros(),
            max_run_chunks: config.suballoc_threshold.div_ceil(config.chunk_size) as u32,
            config,
            state: Mutex::new(State::default()),
        })
    }

    /// The sizes in use.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// The device backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The usage ledger.
    pub fn ledger(&self) -> &L {
        &self.ledger
    }

    /// The ledger's usage and limit of `device`.
    pub fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        self.ledger.usage(device)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; if one ever did, the state is still
        // structurally valid, and the hook must keep working rather than abort.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserve `bytes` of `class` on `device`; when the limit refuses, first give warm
    /// empty regions of that device back and try once more. For usage the hook charges
    /// without a table entry.
    pub fn reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<Reservation<'_>, OutOfMemory> {
        match Reservation::new(&self.ledger, device, class, bytes) {
            Ok(r) => Ok(r),
            Err(oom) => {
                if self.evict_empty_regions(Some(device)) == 0 {
                    return Err(oom);
                }
                Reservation::new(&self.ledger, device, class, bytes)
            }
        }
    }

    /// Allocate `bytes` of device memory in `context` (`cuMemAlloc`).
    ///
    /// Below the sub-allocation threshold the request is served in whole chunks from a
    /// region of this context (creating one if needed); otherwise, or when a new region
    /// would not fit the limit or the device, it goes straight to the device.
    pub fn allocate(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u64,
    ) -> Result<Allocated, AllocError> {
        if bytes == 0 {
            return Err(AllocError::InvalidValue("zero-byte allocation"));
        }
        if !self.ledger.has_device(device) {
            return Err(AllocError::InvalidValue("device index out of range"));
        }
        if self.config.suballoc && bytes < self.config.suballoc_threshold {
            // Cannot truncate: bytes < threshold <= 4 GiB (checked by the config).
            let bytes = bytes as u32;
            if let Some(done) = self.suballoc_existing(device, context, bytes) {
                return Ok(done);
            }
            if let Some(done) = self.suballoc_new_region(device, context, bytes)? {
                return Ok(done);
            }
            // The region did not fit the limit or the device: fall through to direct.
        }
        self.allocate_direct(device, context, bytes)
    }

    /// Free the allocation whose base is `ptr` (`cuMemFree`), whatever made it, and
    /// release what it was charged. `NotTracked` means the hook should pass the call to
    /// the driver unchanged (the driver then answers as it would without vgpu).
    pub fn free(&self, ptr: DevicePtr) -> Result<Freed, FreeError> {
        let st = self.lock();
        if let Some((rid, _, chunk)) = st.region_at(ptr.0, self.chunk_shift) {
            return self.free_suballocation(st, ptr, rid, chunk);
        }
        let mut st = st;
        let entry = st.table.remove_address(ptr).ok_or(FreeError::NotTracked)?;
        self.finish_removal(st, entry, true)
    }

    /// Remove `(kind, key)` and release its charge without calling the device, for
    /// allocations the hook frees itself (`cuMemFreeAsync`, `cuArrayDestroy`,
    /// `cuMemRelease`, `cuModuleUnload`), after the driver freed them. Sub-allocated
    /// chunks go back to their region.
    pub fn release_record(&self, kind: AllocationKind, key: u64) -> Result<Freed, FreeError> {
        let mut st = self.lock();
        if kind == AllocationKind::SubAllocated {
            let Some((rid, _, chunk)) = st.region_at(key, self.chunk_shift) else {
                return Err(FreeError::NotTracked);
            };
            return self.free_suballocation(st, DevicePtr(key), rid, chunk);
        }
        let entry = st.table.remove(kind, key).ok_or(FreeError::NotTracked)?;
        self.finish_removal(st, entry, false)
    }

    /// Give every warm empty region back to the device (all devices). Returns how many.
    pub fn trim(&self) -> usize {
        self.evict_empty_regions(None)
    }
}
