//! Pinned host memory (`cuMemAllocHost`, `cuMemHostAlloc`, `cuMemHostRegister`) and the host
//! limit it, and host-located `cuMemCreate` memory, count against.
//!
//! With unified addressing (every 64-bit platform since CUDA 4.0) a pinned range's device
//! pointer is its host address, so kernels, copies and memsets reach it at
//! `cuMemHostGetDevicePointer`'s answer whatever the `DEVICEMAP` flag. It is not device memory:
//! `cuMemGetInfo` and NVML do not count it. The host limit (`VGPU_SIM_HOST_PINNED_LIMIT`)
//! stands for what the host lets a process lock (`RLIMIT_MEMLOCK`, the container's memory
//! cgroup); past it the answer is `CUDA_ERROR_OUT_OF_MEMORY`, the real driver's when the kernel
//! refuses to pin (`cudaErrorMemoryAllocation` from `cudaHostAlloc`/`cudaHostRegister`).

use super::*;

/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED`.
const HOST_ALLOC_FLAGS: u32 = 0x7;
/// `CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY`.
const HOST_REGISTER_FLAGS: u32 = 0xf;

/// Host memory the process holds pinned or host-located, against the host's limit.
#[derive(Debug)]
pub struct HostMemory {
    limit: Option<u64>,
    used: AtomicU64,
}

impl HostMemory {
    /// Nothing held yet; `limit` `None` = no limit.
    pub fn new(limit: Option<u64>) -> HostMemory {
        HostMemory {
            limit,
            used: AtomicU64::new(0),
        }
    }

    /// Bytes held (page-rounded pinned ranges, host-located `cuMemCreate` sizes).
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub(super) fn reserve(&self, bytes: u64) -> CuResult<()> {
        reserve_under(&self.used, self.limit.unwrap_or(u64::MAX), bytes)
    }

    pub(super) fn release(&self, bytes: u64) {
        release_from(&self.used, bytes)
    }
}

/// What a pinned allocation and a registration both are: bytes of host memory pinned with
/// `flags` by context `ctx`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pinning {
    pub(super) size: u64,
    pub(super) flags: u32,
    pub(super) ctx: u64,
}

/// A `cuMemAllocHost`/`cuMemHostAlloc` allocation.
#[derive(Debug)]
pub(super) struct PinnedAlloc {
    pub(super) region: Arc<HostRegion>,
    pub(super) pinning: Pinning,
}

/// A `cuMemHostRegister` range of the program's own memory.
#[derive(Debug)]
pub(super) struct Registration {
    pub(super) ptr: HostPtr,
    pub(super) accounted: u64,
    pub(super) pinning: Pinning,
}

/// What a pointer into pinned memory lies in.
#[derive(Debug, Clone, Copy)]
pub(super) struct PinnedRange {
    pub(super) base: u64,
    pub(super) pinning: Pinning,
}

/// Pages spanned by `[p, p + size)`.
fn pages(p: u64, size: u64) -> Option<u64> {
    let page = hostmem::page_size() as u64;
    let start = p / page * page;
    Some(round_up(p.checked_add(size)?, page)? - start)
}

impl State {
    /// The pinned allocation or registration containing `p`.
    pub(super) fn pinned_at(&self, p: u64) -> Option<PinnedRange> {
        // The range starting at or below `p`, if it reaches `p`.
        let holding = |base: u64, pin: &Pinning| {
            (p < base + pin.size).then_some(PinnedRange {
                base,
                pinning: *pin,
            })
        };
        let alloc = self.pinned.range(..=p).next_back();
        alloc
            .and_then(|(b, a)| holding(*b, &a.pinning))
            .or_else(|| {
                let reg = self.registered.range(..=p).next_back();
                reg.and_then(|(b, r)| holding(*b, &r.pinning))
            })
    }

    /// `[p, p + len)` inside one pinned allocation or registration.
    pub(super) fn pinned_span(&self, p: u64, len: u64) -> Option<Span<'_>> {
        let r = self.pinned_at(p)?;
        if let Some(a) = self.pinned.get(&r.base) {
            return a.region.span(r.base, a.pinning.size)?.sub(p, len);
        }
        let reg = self.registered.get(&r.base)?;
        reg.ptr.span(reg.pinning.size)?.sub(p, len)
    }
}

impl Sim {
    /// `cuMemAllocHost` (`flags` 0) / `cuMemHostAlloc`.
    pub fn host_alloc(&self, size: u64, flags: u32) -> CuResult<u64> {
        let ctx = self.current()?;
        if size == 0 || flags & !HOST_ALLOC_FLAGS != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let r = HostRegion::new(size as usize).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.host.reserve(r.len() as u64)?;
        let a = r.addr();
        let pinned = PinnedAlloc {
            region: Arc::new(r),
            pinning: Pinning { size, flags, ctx },
        };
        self.st().pinned.insert(a, pinned);
        Ok(a)
    }

    /// `cuMemFreeHost`.
    pub fn host_free(&self, p: u64) -> CuResult<()> {
        let a = self
            .st()
            .pinned
            .remove(&p)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.host.release(a.region.len() as u64);
        Ok(())
    }

    /// `cuMemHostRegister`: the program's `[p, p + size)` becomes pinned, reachable at a
    /// device pointer, until `cuMemHostUnregister`.
    pub fn host_register(&self, p: HostPtr, size: u64, flags: u32) -> CuResult<()> {
        let ctx = self.current()?;
        if size == 0 || flags & !HOST_REGISTER_FLAGS != 0 || p.span(size).is_none() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let base = p.addr();
        let accounted = pages(base, size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        let overlaps = st.pinned_at(base).is_some()
            || st.registered.range(base..base + size).next().is_some()
            || st.pinned.range(base..base + size).next().is_some();
        if overlaps {
            return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        self.host.reserve(accounted)?;
        st.registered.insert(
            base,
            Registration {
                ptr: p,
                accounted,
                pinning: Pinning { size, flags, ctx },
            },
        );
        Ok(())
    }

    /// `cuMemHostUnregister` (`p` is the registered base).
    pub fn host_unregister(&self, p: u64) -> CuResult<()> {
        self.current()?;
        let r = self
            .st()
            .registered
            .remove(&p)
            .ok_or(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)?;
        self.host.release(r.accounted);
        Ok(())
    }

    /// `cuMemHostGetDevicePointer_v2`: the device address of pinned host memory (the same
    /// address, under unified addressing). `flags` must be 0.
    pub fn host_device_pointer(&self, p: u64, flags: u32) -> CuResult<u64> {
        self.current()?;
        if flags != 0 || self.st().pinned_at(p).is_none() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(p)
    }

    /// `cuMemHostGetFlags`: the flags pinned memory was allocated or registered with.
    pub fn host_flags(&self, p: u64) -> CuResult<u32> {
        self.current()?;
        self.st()
            .pinned_at(p)
            .map(|r| r.pinning.flags)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }
}
