//! Calls into the real driver that the accounting needs, wrapped so the rest of the hook
//! does not touch raw function pointers. Handles (`CUstream`, `CUmemoryPool`, ...) are
//! opaque values the driver validates itself.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use vgpu_alloc_core::{BackendError, ContextId, DeviceBackend, DeviceIndex, DevicePtr, MemoryInfo};
use vgpu_cuda_abi::*;

use crate::real::{self, Cuda};

/// A real function the driver may lack (an older driver): `NOT_SUPPORTED` then. Each call
/// below is a real driver entry point of exactly its declared signature (the declaration
/// list), called with arguments that satisfy its contract (said at each call).
#[inline(always)]
pub(crate) fn have<F>(f: Option<F>) -> Result<F, CUresult> {
    f.ok_or(CUresult::NOT_SUPPORTED)
}

/// The current context (`cuCtxGetCurrent`); `INVALID_CONTEXT` when there is none.
pub(crate) fn current_context(cuda: &Cuda) -> Result<CUcontext, CUresult> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    unsafe { have(cuda.u.cuCtxGetCurrent)?(&mut ctx) }.ok()?;
    if ctx.is_null() {
        Err(CUresult::INVALID_CONTEXT)
    } else {
        Ok(ctx)
    }
}

/// The current context's device (`cuCtxGetDevice`).
pub(crate) fn current_device(cuda: &Cuda) -> Result<CUdevice, CUresult> {
    let mut dev = CUdevice(0);
    // SAFETY: a valid out-pointer.
    unsafe { have(cuda.u.cuCtxGetDevice)?(&mut dev) }.ok()?;
    Ok(dev)
}

thread_local! {
    /// The last `(context, device, generation)` this thread resolved.
    static LAST_CONTEXT: Cell<(usize, i32, u64)> = const { Cell::new((0, 0, u64::MAX)) };
}

/// Bumped whenever a context may have been destroyed (its handle could then be reused for a
/// context on another device), which invalidates every thread's cached device.
static CONTEXT_GENERATION: AtomicU64 = AtomicU64::new(0);

/// A context was (or may have been) destroyed: forget cached context → device pairs.
pub(crate) fn contexts_changed() {
    CONTEXT_GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// The current context and its device. The device of a context never changes while it
/// lives, so it is cached per thread; the allocation path then makes one driver call here
/// instead of two.
pub(crate) fn current(cuda: &Cuda) -> Result<(CUcontext, CUdevice), CUresult> {
    let ctx = current_context(cuda)?;
    let generation = CONTEXT_GENERATION.load(Ordering::Acquire);
    let (c, d, g) = LAST_CONTEXT.with(Cell::get);
    if c == ctx as usize && g == generation {
        return Ok((ctx, CUdevice(d)));
    }
    let dev = current_device(cuda)?;
    LAST_CONTEXT.with(|l| l.set((ctx as usize, dev.0, generation)));
    Ok((ctx, dev))
}

/// The device a stream's work runs on. The null (default) streams belong to the current
/// context; other streams may belong to another context, made current briefly.
pub(crate) fn stream_device(cuda: &Cuda, stream: CUstream) -> Result<CUdevice, CUresult> {
    // CU_STREAM_LEGACY (0x1) and CU_STREAM_PER_THREAD (0x2) are also current-context streams.
    if (stream as usize) <= 2 {
        return current_device(cuda);
    }
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: the caller's stream handle (the driver validates it) and a valid out-pointer.
    unsafe { have(cuda.u.cuStreamGetCtx)?(stream, &mut ctx) }.ok()?;
    let cur = current_context(cuda).unwrap_or(std::ptr::null_mut());
    if ctx.is_null() || ctx == cur {
        return current_device(cuda);
    }
    // SAFETY: a context the driver just named.
    unsafe { have(cuda.u.cuCtxPushCurrent_v2)?(ctx) }.ok()?;
    let dev = current_device(cuda);
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; pops what was pushed above.
    let _ = have(cuda.u.cuCtxPopCurrent_v2).map(|pop| unsafe { pop(&mut popped) });
    dev
}

/// Whether work submitted to `stream` is being captured into a graph (then a stream-ordered
/// allocation becomes a graph memory node). `per_thread`: the null stream means the calling
/// thread's default stream (a `_ptsz` entry point).
pub(crate) fn stream_capturing(cuda: &Cuda, stream: CUstream, per_thread: bool) -> bool {
    // CU_STREAM_PER_THREAD names the per-thread default stream from any entry point.
    let stream = if stream.is_null() && per_thread {
        2usize as CUstream
    } else {
        stream
    };
    let mut status = CUstreamCaptureStatus::NONE;
    let Ok(is_capturing) = have(cuda.u.cuStreamIsCapturing) else {
        return false;
    };
    // SAFETY: the caller's stream handle (the driver validates it) and a valid out-pointer.
    unsafe { is_capturing(stream, &mut status) }.is_success()
        && status != CUstreamCaptureStatus::NONE
}

/// `cuMemFree_v2(ptr)`: gives back memory the driver allocated (a pointer it returned).
pub(crate) fn mem_free(cuda: &Cuda, ptr: CUdeviceptr) -> Result<(), CUresult> {
    // SAFETY: a device pointer the driver returned (it validates it).
    unsafe { have(cuda.h.cuMemFree_v2)?(ptr) }.ok()
}

/// `cuStreamSynchronize(stream)`, or its `_ptsz` twin when `per_thread`.
pub(crate) fn stream_synchronize(
    cuda: &Cuda,
    stream: CUstream,
    per_thread: bool,
) -> Result<(), CUresult> {
    let sync = if per_thread {
        cuda.h.cuStreamSynchronize_ptsz
    } else {
        cuda.h.cuStreamSynchronize
    };
    // SAFETY: the caller's stream handle (the driver validates it).
    unsafe { have(sync)?(stream) }.ok()
}

/// `cuModuleUnload(module)`.
pub(crate) fn module_unload(cuda: &Cuda, module: CUmodule) -> Result<(), CUresult> {
    // SAFETY: a module handle the driver returned (it validates it).
    unsafe { have(cuda.h.cuModuleUnload)?(module) }.ok()
}

/// `cuLibraryUnload(library)`.
pub(crate) fn library_unload(cuda: &Cuda, library: CUlibrary) -> Result<(), CUresult> {
    // SAFETY: a library handle the driver returned (it validates it).
    unsafe { have(cuda.h.cuLibraryUnload)?(library) }.ok()
}

/// `cuCtxDestroy_v2(ctx)`.
pub(crate) fn ctx_destroy(cuda: &Cuda, ctx: CUcontext) -> Result<(), CUresult> {
    // SAFETY: a context the driver returned (it validates it).
    unsafe { have(cuda.h.cuCtxDestroy_v2)?(ctx) }.ok()
}

/// `cuDevicePrimaryCtxRelease_v2(dev)`.
pub(crate) fn primary_ctx_release(cuda: &Cuda, dev: CUdevice) -> Result<(), CUresult> {
    // SAFETY: no pointer arguments; the driver validates the ordinal.
    unsafe { have(cuda.h.cuDevicePrimaryCtxRelease_v2)?(dev) }.ok()
}

/// Physical `(free, total)` of the current context's device (real `cuMemGetInfo_v2`).
pub(crate) fn mem_get_info(cuda: &Cuda) -> Result<(u64, u64), CUresult> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    unsafe { have(cuda.h.cuMemGetInfo_v2)?(&mut free, &mut total) }.ok()?;
    Ok((free as u64, total as u64))
}

/// A `cuuint64_t` attribute of a memory pool.
pub(crate) fn pool_attr(
    cuda: &Cuda,
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
) -> Result<u64, CUresult> {
    let mut v: u64 = 0;
    // SAFETY: the pool attributes asked for here are `cuuint64_t`s; `v` is one.
    unsafe { have(cuda.u.cuMemPoolGetAttribute)?(pool, attr, (&raw mut v).cast()) }.ok()?;
    Ok(v)
}

/// The current memory pool of a device (what `cuMemAllocAsync` uses).
pub(crate) fn device_mem_pool(cuda: &Cuda, dev: CUdevice) -> Result<CUmemoryPool, CUresult> {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    unsafe { have(cuda.u.cuDeviceGetMemPool)?(&mut pool, dev) }.ok()?;
    Ok(pool)
}

/// Which device `pool` belongs to, if it is some device's default or current pool.
pub(crate) fn find_pool_device(cuda: &Cuda, pool: CUmemoryPool) -> Option<CUdevice> {
    let n = device_count(cuda).ok()?;
    (0..n).map(CUdevice).find(|&d| {
        let mut p: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let default =
            have(cuda.u.cuDeviceGetDefaultMemPool).and_then(|get| unsafe { get(&mut p, d) }.ok());
        (default.is_ok() && p == pool) || device_mem_pool(cuda, d).is_ok_and(|p| p == pool)
    })
}

/// Graph memory the driver holds for `dev` (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`).
pub(crate) fn graph_mem_reserved(cuda: &Cuda, dev: CUdevice) -> Result<u64, CUresult> {
    let mut v: u64 = 0;
    let attr = CUgraphMem_attribute::RESERVED_MEM_CURRENT;
    // SAFETY: this attribute is a `cuuint64_t`; `v` is one.
    unsafe { have(cuda.u.cuDeviceGetGraphMemAttribute)?(dev, attr, (&raw mut v).cast()) }.ok()?;
    Ok(v)
}

/// Minimum allocation granularity for `prop` (`cuMemCreate` sizes are multiples of it).
pub(crate) fn granularity(cuda: &Cuda, prop: &CUmemAllocationProp) -> Result<u64, CUresult> {
    let mut g: usize = 0;
    let minimum = CUmemAllocationGranularity_flags::MINIMUM;
    // SAFETY: a valid out-pointer and a valid property struct.
    unsafe { have(cuda.u.cuMemGetAllocationGranularity)?(&mut g, prop, minimum) }.ok()?;
    Ok(g as u64)
}

/// Whether the device's primary context is active (`cuDevicePrimaryCtxGetState`).
pub(crate) fn primary_ctx_active(cuda: &Cuda, dev: CUdevice) -> Result<bool, CUresult> {
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe { have(cuda.u.cuDevicePrimaryCtxGetState)?(dev, &mut flags, &mut active) }.ok()?;
    Ok(active != 0)
}

/// Number of devices this process sees (`cuDeviceGetCount`).
pub(crate) fn device_count(cuda: &Cuda) -> Result<i32, CUresult> {
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer.
    unsafe { have(cuda.u.cuDeviceGetCount)?(&mut n) }.ok()?;
    Ok(n)
}

/// NVML-style UUID string of a CUDA device.
pub(crate) fn device_uuid(cuda: &Cuda, dev: CUdevice) -> Result<String, CUresult> {
    let mut u = CUuuid::default();
    // The GPU's own UUID (what NVML reports); drivers that dropped the v1 entry point have v2,
    // which answers the same for a non-MIG device.
    let v1 = have(cuda.u.cuDeviceGetUuid).and_then(|get| {
        // SAFETY: a valid out-pointer.
        unsafe { get(&mut u, dev) }.ok()
    });
    if v1 == Err(CUresult::NOT_SUPPORTED) {
        // SAFETY: a valid out-pointer.
        unsafe { have(cuda.u.cuDeviceGetUuid_v2)?(&mut u, dev) }.ok()?;
    } else {
        v1?;
    }
    Ok(format_gpu_uuid(&u))
}

/// UUIDs of every GPU NVML sees, in NVML index order (initializes NVML, never CUDA).
/// Empty when NVML is not available.
pub(crate) fn nvml_uuids() -> Vec<String> {
    let Ok(nvml) = real::nvml() else {
        return Vec::new();
    };
    let (Some(init), Some(count), Some(by_index)) = (
        nvml.u.nvmlInit_v2,
        nvml.u.nvmlDeviceGetCount_v2,
        nvml.u.nvmlDeviceGetHandleByIndex_v2,
    ) else {
        return Vec::new();
    };
    // SAFETY: nvmlInit_v2 takes no arguments; repeated calls only bump a reference count.
    if !unsafe { init() }.is_success() {
        return Vec::new();
    }
    let mut n: c_uint = 0;
    // SAFETY: a valid out-pointer.
    if !unsafe { count(&mut n) }.is_success() {
        return Vec::new();
    }
    (0..n)
        .map(|i| {
            let mut handle: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: an index below the count and a valid out-pointer.
            let found = unsafe { by_index(i, &mut handle) }.is_success();
            found
                .then(|| nvml_uuid(nvml, handle))
                .flatten()
                .unwrap_or_default()
        })
        .collect()
}

/// UUID of an NVML device handle.
pub(crate) fn nvml_uuid(nvml: &real::Nvml, device: nvmlDevice_t) -> Option<String> {
    let f = nvml.u.nvmlDeviceGetUUID?;
    let mut buf = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    // SAFETY: the buffer is as long as we say; NVML NUL-terminates on success.
    let r = unsafe { f(device, buf.as_mut_ptr(), buf.len() as c_uint) };
    if !r.is_success() {
        return None;
    }
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c.to_ne_bytes()[0])
        .collect();
    String::from_utf8(bytes).ok()
}

/// The NVML handle of a CUDA device (found by UUID; initializes NVML). `None` when NVML is
/// not available.
pub(crate) fn nvml_device(cuda: &Cuda, dev: CUdevice) -> Option<nvmlDevice_t> {
    let nvml = real::nvml().ok()?;
    let uuid = device_uuid(cuda, dev).ok()?;
    let cuuid = std::ffi::CString::new(uuid).ok()?;
    if let Some(init) = nvml.u.nvmlInit_v2 {
        // SAFETY: nvmlInit_v2 takes no arguments; repeated calls only bump a reference count.
        unsafe { init() };
    }
    let by_uuid = nvml.u.nvmlDeviceGetHandleByUUID?;
    let mut handle: nvmlDevice_t = std::ptr::null_mut();
    // SAFETY: NUL-terminated UUID and a valid out-pointer.
    if !unsafe { by_uuid(cuuid.as_ptr(), &mut handle) }.is_success() {
        return None;
    }
    Some(handle)
}

/// One process's memory on one device as NVML's process list reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProcessUsage {
    /// Listed, using this many bytes.
    Used(u64),
    /// NVML answered, but the pid is not among the `listed` processes.
    NotListed {
        /// How many processes NVML listed on the device.
        listed: usize,
    },
    /// NVML (or the per-process figure) is not available.
    Unavailable,
}

/// Device memory NVML reports for `pid` on `device` (`nvmlDeviceGetComputeRunningProcesses`,
/// `_v3` or else `_v2`; several entries of one pid, e.g. MIG instances, are summed).
pub(crate) fn nvml_process_used(device: nvmlDevice_t, pid: u32) -> ProcessUsage {
    let Ok(nvml) = real::nvml() else {
        return ProcessUsage::Unavailable;
    };
    let Some(list) = nvml
        .u
        .nvmlDeviceGetComputeRunningProcesses_v3
        .or(nvml.u.nvmlDeviceGetComputeRunningProcesses_v2)
    else {
        return ProcessUsage::Unavailable;
    };
    let mut infos = vec![nvmlProcessInfo_t::default(); 32];
    let mut count: c_uint = 0;
    let mut answered = false;
    // The list may grow between two calls: retry a few times with the size NVML asks for.
    for _ in 0..4 {
        count = infos.len() as c_uint;
        // SAFETY: `infos` holds `count` entries of the struct both versions write.
        let r = unsafe { list(device, &mut count, infos.as_mut_ptr()) };
        if r.is_success() {
            answered = true;
            break;
        }
        if r != nvmlReturn_t::INSUFFICIENT_SIZE {
            return ProcessUsage::Unavailable;
        }
        infos.resize(count as usize + 16, nvmlProcessInfo_t::default());
    }
    if !answered {
        return ProcessUsage::Unavailable;
    }
    let listed = &infos[..(count as usize).min(infos.len())];
    let mine: Vec<u64> = listed
        .iter()
        .filter(|p| p.pid == pid)
        .map(|p| p.usedGpuMemory)
        .collect();
    if mine.is_empty() {
        return ProcessUsage::NotListed {
            listed: listed.len(),
        };
    }
    if mine.contains(&NVML_VALUE_NOT_AVAILABLE) {
        return ProcessUsage::Unavailable;
    }
    ProcessUsage::Used(mine.iter().fold(0u64, |a, &b| a.saturating_add(b)))
}

/// A CUDA device's memory as NVML reports it (the real figures, no context needed). `None`
/// when NVML is not available.
fn nvml_memory(cuda: &Cuda, dev: CUdevice) -> Option<nvmlMemory_t> {
    let nvml = real::nvml().ok()?;
    let handle = nvml_device(cuda, dev)?;
    let get = nvml.h.nvmlDeviceGetMemoryInfo?;
    let mut m = nvmlMemory_t::default();
    // SAFETY: a handle NVML just gave us and a valid out-pointer.
    unsafe { get(handle, &mut m) }.is_success().then_some(m)
}

/// Memory used on a CUDA device as NVML reports it, for measuring what context creation
/// takes.
pub(crate) fn nvml_used_bytes(cuda: &Cuda, dev: CUdevice) -> Option<u64> {
    nvml_memory(cuda, dev).map(|m| m.used)
}

/// Free memory of a CUDA device that need not be the current context's, as NVML reports it.
pub(crate) fn nvml_free_bytes(cuda: &Cuda, dev: CUdevice) -> Option<u64> {
    nvml_memory(cuda, dev).map(|m| m.free)
}

/// The real driver as the allocator's device backend: `cuMemAlloc_v2`/`cuMemFree_v2` in
/// the caller's current context (the allocator is only called from inside the hooked
/// call, with the caller's context current).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RealBackend;

fn backend_err(r: CUresult) -> BackendError {
    BackendError { code: r.0 }
}

impl DeviceBackend for RealBackend {
    fn allocate(
        &self,
        _device: DeviceIndex,
        _context: ContextId,
        bytes: u64,
    ) -> Result<DevicePtr, BackendError> {
        let cuda = real::cuda().map_err(backend_err)?;
        let size = usize::try_from(bytes).map_err(|_| BackendError::OUT_OF_MEMORY)?;
        let mut p = CUdeviceptr(0);
        // SAFETY: a valid out-pointer, in the caller's current context.
        unsafe { have(cuda.h.cuMemAlloc_v2).map_err(backend_err)?(&mut p, size) }
            .ok()
            .map_err(backend_err)?;
        Ok(DevicePtr(p.0))
    }

    fn free(
        &self,
        _device: DeviceIndex,
        _context: ContextId,
        ptr: DevicePtr,
    ) -> Result<(), BackendError> {
        let cuda = real::cuda().map_err(backend_err)?;
        // Unified addressing: cuMemFree takes any context's pointer.
        mem_free(cuda, CUdeviceptr(ptr.0)).map_err(backend_err)
    }

    fn memory_info(&self, _device: DeviceIndex) -> Result<MemoryInfo, BackendError> {
        let cuda = real::cuda().map_err(backend_err)?;
        let (free, total) = mem_get_info(cuda).map_err(backend_err)?;
        Ok(MemoryInfo { free, total })
    }
}

// --- Virtual memory for host-backed allocations (`host_backing`) ---

/// Pinned memory at `location` (a device ordinal, or the host).
pub(crate) fn pinned_prop(location: CUmemLocation) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::PINNED,
        requestedHandleTypes: 0,
        location,
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: CUmemAllocationPropFlags::default(),
    }
}

/// The real `cuMemCreate` (not our hook: the caller accounts for it itself).
pub(crate) fn mem_create(
    cuda: &Cuda,
    size: u64,
    prop: &CUmemAllocationProp,
) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let mut h = CUmemGenericAllocationHandle(0);
    // SAFETY: a valid out-pointer and property struct; flags must be 0.
    unsafe { have(cuda.h.cuMemCreate)?(&mut h, size as usize, prop, 0) }.ok()?;
    Ok(h)
}

/// The device a VMM handle's memory is located on (the real
/// `cuMemGetAllocationPropertiesFromHandle`); `None` for host-located memory or a failure.
pub(crate) fn handle_device(cuda: &Cuda, h: CUmemGenericAllocationHandle) -> Option<CUdevice> {
    // SAFETY: all-zero is a valid CUmemAllocationProp (plain integers and a null pointer).
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer; the driver validates the handle.
    unsafe { have(cuda.h.cuMemGetAllocationPropertiesFromHandle).ok()?(&mut prop, h) }
        .ok()
        .ok()?;
    (prop.location.type_ == CUmemLocationType::DEVICE).then_some(CUdevice(prop.location.id))
}

/// The real `cuMemRelease` (not our hook).
pub(crate) fn mem_release(cuda: &Cuda, h: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    // SAFETY: a handle `mem_create` returned (the driver validates it).
    unsafe { have(cuda.h.cuMemRelease)?(h) }.ok()
}

/// `cuMemAddressReserve`: `size` bytes of address space aligned to `align`.
pub(crate) fn address_reserve(cuda: &Cuda, size: u64, align: u64) -> Result<CUdeviceptr, CUresult> {
    let mut p = CUdeviceptr(0);
    // SAFETY: a valid out-pointer; no fixed address, no flags.
    unsafe {
        have(cuda.u.cuMemAddressReserve)?(&mut p, size as usize, align as usize, CUdeviceptr(0), 0)
    }
    .ok()?;
    Ok(p)
}

/// `cuMemAddressFree` of a range `address_reserve` returned.
pub(crate) fn address_free(cuda: &Cuda, p: CUdeviceptr, size: u64) -> Result<(), CUresult> {
    // SAFETY: a reservation's base and size (the driver validates them).
    unsafe { have(cuda.u.cuMemAddressFree)?(p, size as usize) }.ok()
}

/// `cuMemMap` of all of `h` at `p`, then read-write access for device `dev` there.
pub(crate) fn map_for_device(
    cuda: &Cuda,
    p: CUdeviceptr,
    size: u64,
    h: CUmemGenericAllocationHandle,
    dev: CUdevice,
) -> Result<(), CUresult> {
    // SAFETY: a reserved range and a handle of at least `size` bytes (the driver checks both).
    unsafe { have(cuda.h.cuMemMap)?(p, size as usize, 0, h, 0) }.ok()?;
    let access = CUmemAccessDesc {
        location: CUmemLocation {
            type_: CUmemLocationType::DEVICE,
            id: dev.0,
        },
        flags: 3, // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    };
    // SAFETY: one valid descriptor for the range just mapped.
    let granted = unsafe { have(cuda.h.cuMemSetAccess)?(p, size as usize, &access, 1) }.ok();
    if granted.is_err() {
        let _ = unmap(cuda, p, size);
    }
    granted
}

/// The real `cuMemMap` (not our hook) of `size` bytes of `h` from `offset` at `p`.
pub(crate) fn map(
    cuda: &Cuda,
    p: CUdeviceptr,
    size: u64,
    offset: u64,
    h: CUmemGenericAllocationHandle,
) -> Result<(), CUresult> {
    // SAFETY: plain values; the driver validates the range, offset and handle.
    unsafe { have(cuda.h.cuMemMap)?(p, size as usize, offset as usize, h, 0) }.ok()
}

/// The real `cuMemSetAccess` (not our hook) of `descs` over a mapped range.
pub(crate) fn set_access(
    cuda: &Cuda,
    p: CUdeviceptr,
    size: u64,
    descs: &[CUmemAccessDesc],
) -> Result<(), CUresult> {
    if descs.is_empty() {
        return Ok(());
    }
    // SAFETY: `descs.len()` valid descriptors.
    unsafe { have(cuda.h.cuMemSetAccess)?(p, size as usize, descs.as_ptr(), descs.len()) }.ok()
}

/// The real `cuMemRetainAllocationHandle` (not our hook) of the memory mapped at `va`: a
/// reference more to it.
pub(crate) fn retain_at(cuda: &Cuda, va: u64) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let mut h = CUmemGenericAllocationHandle(0);
    // SAFETY: a valid out-pointer; the driver validates the address.
    unsafe { have(cuda.h.cuMemRetainAllocationHandle)?(&mut h, va as *mut c_void) }.ok()?;
    Ok(h)
}

/// `cuMemUnmap` of a mapped range.
pub(crate) fn unmap(cuda: &Cuda, p: CUdeviceptr, size: u64) -> Result<(), CUresult> {
    // SAFETY: a mapped range (the driver validates it).
    unsafe { have(cuda.h.cuMemUnmap)?(p, size as usize) }.ok()
}

/// The real `cuCtxSynchronize` (not our hook): waits for the current context's work.
pub(crate) fn ctx_synchronize(cuda: &Cuda) -> Result<(), CUresult> {
    // SAFETY: no arguments.
    unsafe { have(cuda.h.cuCtxSynchronize)?() }.ok()
}

/// Makes `ctx` current on this thread above the one there (`cuCtxPushCurrent_v2`).
pub(crate) fn push_context(cuda: &Cuda, ctx: CUcontext) -> Result<(), CUresult> {
    // SAFETY: a context of this process the census holds alive (the caller's promise: it
    // holds the swap lock, or a pin of this context, and no end of it can run meanwhile,
    // docs/swap.md).
    unsafe { have(cuda.u.cuCtxPushCurrent_v2)?(ctx) }.ok()
}

/// Undoes [`push_context`].
pub(crate) fn pop_context(cuda: &Cuda) -> Result<(), CUresult> {
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; pops what the caller pushed.
    unsafe { have(cuda.u.cuCtxPopCurrent_v2)?(&mut popped) }.ok()
}

/// `cuMemcpyDtoD_v2`: synchronous with respect to the host.
pub(crate) fn copy_dtod(
    cuda: &Cuda,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: u64,
) -> Result<(), CUresult> {
    // SAFETY: two mapped ranges of at least `n` bytes (the driver validates them).
    unsafe { have(cuda.h.cuMemcpyDtoD_v2)?(dst, src, n as usize) }.ok()
}

/// `cuMemcpyDtoH_v2` of `dst.len()` bytes from `src` into host memory (pageable or not):
/// synchronous with respect to the host.
pub(crate) fn copy_dtoh(cuda: &Cuda, dst: &mut [u8], src: CUdeviceptr) -> Result<(), CUresult> {
    // SAFETY: `dst` is writable for its length; the driver validates the device range.
    unsafe { have(cuda.h.cuMemcpyDtoH_v2)?(dst.as_mut_ptr().cast(), src, dst.len()) }.ok()
}

/// `cuMemcpyHtoD_v2` of `src.len()` bytes from host memory (pageable or not) to `dst`:
/// synchronous with respect to the host (the driver has read `src` when it returns).
pub(crate) fn copy_htod(cuda: &Cuda, dst: CUdeviceptr, src: &[u8]) -> Result<(), CUresult> {
    // SAFETY: `src` is readable for its length; the driver validates the device range.
    unsafe { have(cuda.h.cuMemcpyHtoD_v2)?(dst, src.as_ptr().cast(), src.len()) }.ok()
}
