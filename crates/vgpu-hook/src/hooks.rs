//! The implementation behind every export (same names as the symbols). FFI boundary:
//! raw caller pointers are read and written here through `crate::ffi`, real functions are
//! called through `driver::call!`; all accounting decisions are made by the allocator
//! (`vgpu-alloc-core`), [`crate::measured`] and [`crate::accounting`], which are safe Rust.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::Ordering;

use vgpu_alloc_core::{
    AllocError, AllocationKind, ContextId, DeviceBackend, DeviceIndex, DevicePtr, FreeError,
    MAX_DEVICES, OutOfMemory, PendingRecord, UsageClass, UsageLedger,
};
use vgpu_cuda_abi::*;

use crate::accounting::{
    align_up, array2d_bytes, array3d_bytes, measured_growth, mipmapped_bytes, virtual_mem_info,
    virtual_nvml_info,
};
use crate::driver::ProcessUsage;
use crate::driver::{self, call};
use crate::ffi::{self, read_back, read_in, write_out};
use crate::log::{DEBUG, ERROR, INFO, MSG, WARN, vlog};
use crate::real::{self, Cuda};
use crate::residual::OverLimit;
use crate::sm_limit::{self, LaunchKind};
use crate::state::{self, Enforcement, Ready};

/// `?` for functions returning `CUresult`.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

/// Pools grow in (at least) 2 MiB steps.
const POOL_GRANULE: u64 = 2 << 20;

fn dev_index(dev: CUdevice) -> Option<DeviceIndex> {
    (0..MAX_DEVICES as i32)
        .contains(&dev.0)
        .then_some(DeviceIndex(dev.0 as u32))
}

fn ctx_id(ctx: CUcontext) -> ContextId {
    ContextId(ctx as u64)
}

/// Memory not tied to a context (VMM handles, pools, graph memory) is keyed by context 0,
/// so destroying a context does not release it.
const NO_CONTEXT: ContextId = ContextId(0);

fn ready_state() -> Option<&'static Ready> {
    match state::get() {
        Enforcement::Ready(r) => Some(r),
        Enforcement::Broken(_) => None,
    }
}

fn log_oom(oom: &OutOfMemory) -> CUresult {
    if crate::state::has_left() {
        // Once: a thread allocating in a loop while the process exits would repeat it.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            vlog!(
                MSG,
                "refusing {} bytes on device {}: this process is exiting and has given its usage \
                 back (further refusals while exiting are not logged)",
                oom.requested,
                oom.device
            );
        }
        return CUresult::OUT_OF_MEMORY;
    }
    vlog!(MSG, "{oom}");
    CUresult::OUT_OF_MEMORY
}

fn alloc_err(e: AllocError) -> CUresult {
    match e {
        AllocError::InvalidValue(_) => CUresult::INVALID_VALUE,
        AllocError::SizeOverflow { .. } => CUresult::OUT_OF_MEMORY,
        AllocError::OutOfMemory(oom) => log_oom(&oom),
        AllocError::Backend(b) => CUresult(b.code),
        AllocError::Internal(why) => {
            vlog!(ERROR, "internal accounting error: {why}");
            CUresult::UNKNOWN
        }
    }
}

fn commit_err(e: AllocError, what: &str) {
    vlog!(
        ERROR,
        "could not record {what}: {e}; its charge stays until the process exits"
    );
}

/// Runs `f`; if the limit refused and pools may hold releasable memory, re-measure the pools
/// (they give memory back at their own pace) and try once more.
fn with_pool_retry<T>(
    st: &Ready,
    cuda: &Cuda,
    mut f: impl FnMut() -> Result<T, AllocError>,
) -> Result<T, AllocError> {
    match f() {
        Err(AllocError::OutOfMemory(oom)) if st.pools.is_active() || st.residual.any_charged() => {
            if st.pools.is_active() {
                settle_all_pools(st, cuda);
            }
            // Code unloaded since the last reconciliation may leave room.
            if st.residual.any_charged() {
                let _ = reconcile(st, cuda, oom.device, OverLimit::Charge);
            }
            f()
        }
        r => r,
    }
}

// ---------------------------------------------------------------------------------------
// Driver-internal memory: reconciled with NVML's per-process used memory (`residual.rs`).

/// NVML's used memory of this process on `dev` (its NVML handle cached per ordinal).
fn process_used(st: &Ready, cuda: &Cuda, dev: CUdevice) -> ProcessUsage {
    let cached = st
        .nvml_handles
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&dev.0)
        .copied();
    let handle = match cached {
        Some(h) => h as nvmlDevice_t,
        None => {
            // Looked up without holding our lock: NVML may enter the loader.
            let Some(h) = driver::nvml_device(cuda, dev) else {
                return ProcessUsage::Unavailable;
            };
            st.nvml_handles
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(dev.0, h as usize);
            h
        }
    };
    driver::nvml_process_used(handle, st.ledger().nvml_pid())
}

/// Brings this process's module charge on `idx` to the residual: NVML's used memory of the
/// process minus everything else vgpu charges for it there. `OverLimit::Refuse` reports a
/// growth the limit refuses instead of charging it.
fn reconcile(
    st: &Ready,
    cuda: &Cuda,
    idx: DeviceIndex,
    mode: OverLimit,
) -> Result<(), OutOfMemory> {
    let ledger = st.ledger();
    if !st.residual.enabled() || !st.residual.tracks(idx) {
        return Ok(()); // off, or no context of ours on this device
    }
    let used = match process_used(st, cuda, CUdevice(idx.0 as i32)) {
        ProcessUsage::Used(u) => u,
        ProcessUsage::Unavailable => return Ok(()),
        ProcessUsage::NotListed { listed } => {
            if !st.residual.has_context(idx) {
                // The last context was destroyed: so is the driver's memory for this process.
                let _ = st
                    .residual
                    .settle(ledger, idx, 0, || ledger.held_by_self(idx), mode);
            } else if st.residual.first_not_listed() {
                let pid = ledger.nvml_pid();
                vlog!(
                    WARN,
                    "device {idx}: NVML does not list this process (pid {pid}) among the {listed} \
                     processes using the GPU, so memory the driver takes for it outside vgpu's view \
                     (lazily loaded code, driver heaps) is not charged while this lasts. NVML lists \
                     host pids: in a container with its own PID namespace the monitor must write the \
                     host pid into the shared file (hostpid). Said once."
                );
            }
            return Ok(());
        }
    };
    let settled = st
        .residual
        .settle(ledger, idx, used, || ledger.held_by_self(idx), mode)?;
    if let Some(oom) = settled.over_limit {
        if st.residual.first_over_limit() {
            vlog!(
                WARN,
                "device {idx}: the driver holds {} bytes for this process outside vgpu's view \
                 (module code, driver heaps); they are charged as module memory although usage is \
                 now {} bytes, over the limit of {} bytes: the memory is already taken. Further \
                 allocations are refused until usage drops. Said once.",
                settled.charged,
                oom.in_use.saturating_add(oom.requested),
                oom.limit
            );
        }
    }
    vlog!(
        DEBUG,
        "device {idx}: NVML says this process uses {used} bytes; driver-internal residual {} bytes",
        settled.charged
    );
    Ok(())
}

/// [`reconcile`] on every device where this process holds memory.
fn reconcile_all(st: &Ready, cuda: &Cuda, mode: OverLimit) -> Result<(), OutOfMemory> {
    st.residual.ran_now();
    for d in 0..MAX_DEVICES as u32 {
        let idx = DeviceIndex(d);
        if st.residual.tracks(idx) {
            reconcile(st, cuda, idx, mode)?;
        }
    }
    Ok(())
}

/// Rate-limited [`reconcile`] for paths that may pay for it now and then (views,
/// driver-reaching allocations): one clock read when not due.
fn reconcile_if_due(st: &Ready, cuda: &Cuda, idx: DeviceIndex) {
    if st.residual.due() {
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
    }
}

/// After a module or library load: charge what it put on the device; a load whose memory
/// the limit refuses is undone and fails with `CUDA_ERROR_OUT_OF_MEMORY`.
fn after_code_load(r: CUresult, unload: impl FnOnce() -> CUresult) -> CUresult {
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    let Ok(cuda) = real::cuda() else { return r };
    match reconcile_all(st, cuda, OverLimit::Refuse) {
        Ok(()) => r,
        Err(oom) => {
            let undone = unload();
            if !undone.is_success() {
                vlog!(
                    ERROR,
                    "could not unload code refused by the limit ({undone:?}); it is charged"
                );
            }
            let _ = reconcile_all(st, cuda, OverLimit::Charge);
            log_oom(&oom)
        }
    }
}

/// Unloads the module a successful load wrote to `module` (refused by the limit).
fn unload_module(cuda: &Cuda, module: *mut CUmodule) -> CUresult {
    // SAFETY: the driver filled the out-pointer (a load fails on null).
    let Some(m) = (unsafe { read_back(module) }) else {
        return CUresult::INVALID_VALUE;
    };
    call!(cuda, h.cuModuleUnload(m))
}

/// Unloads the library a successful load wrote to `library` (refused by the limit).
fn unload_library(cuda: &Cuda, library: *mut CUlibrary) -> CUresult {
    // SAFETY: the driver filled the out-pointer (a load fails on null).
    let Some(l) = (unsafe { read_back(library) }) else {
        return CUresult::INVALID_VALUE;
    };
    call!(cuda, h.cuLibraryUnload(l))
}

/// After a module or library unload (or a context gone): give back what the driver freed.
fn after_code_unload(r: CUresult) -> CUresult {
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        if let Ok(cuda) = real::cuda() {
            let _ = reconcile_all(st, cuda, OverLimit::Charge);
        }
    }
    r
}

pub(crate) unsafe fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuModuleLoad(module, fname));
    after_code_load(r, || unload_module(cuda, module))
}

pub(crate) unsafe fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuModuleLoadData(module, image));
    after_code_load(r, || unload_module(cuda, module))
}

pub(crate) unsafe fn cuModuleLoadDataEx(
    module: *mut CUmodule,
    image: *const c_void,
    num_options: c_uint,
    options: *mut CUjit_option,
    option_values: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(
        cuda,
        h.cuModuleLoadDataEx(module, image, num_options, options, option_values)
    );
    after_code_load(r, || unload_module(cuda, module))
}

pub(crate) unsafe fn cuModuleLoadFatBinary(
    module: *mut CUmodule,
    fat_cubin: *const c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuModuleLoadFatBinary(module, fat_cubin));
    after_code_load(r, || unload_module(cuda, module))
}

pub(crate) unsafe fn cuModuleUnload(hmod: CUmodule) -> CUresult {
    let cuda = tri!(real::cuda());
    after_code_unload(call!(cuda, h.cuModuleUnload(hmod)))
}

pub(crate) unsafe fn cuLibraryLoadData(
    library: *mut CUlibrary,
    code: *const c_void,
    jit_options: *mut CUjit_option,
    jit_options_values: *mut *mut c_void,
    num_jit_options: c_uint,
    library_options: *mut CUlibraryOption,
    library_option_values: *mut *mut c_void,
    num_library_options: c_uint,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(
        cuda,
        h.cuLibraryLoadData(
            library,
            code,
            jit_options,
            jit_options_values,
            num_jit_options,
            library_options,
            library_option_values,
            num_library_options
        )
    );
    after_code_load(r, || unload_library(cuda, library))
}

pub(crate) unsafe fn cuLibraryLoadFromFile(
    library: *mut CUlibrary,
    file_name: *const c_char,
    jit_options: *mut CUjit_option,
    jit_options_values: *mut *mut c_void,
    num_jit_options: c_uint,
    library_options: *mut CUlibraryOption,
    library_option_values: *mut *mut c_void,
    num_library_options: c_uint,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(
        cuda,
        h.cuLibraryLoadFromFile(
            library,
            file_name,
            jit_options,
            jit_options_values,
            num_jit_options,
            library_options,
            library_option_values,
            num_library_options
        )
    );
    after_code_load(r, || unload_library(cuda, library))
}

pub(crate) unsafe fn cuLibraryUnload(library: CUlibrary) -> CUresult {
    let cuda = tri!(real::cuda());
    after_code_unload(call!(cuda, h.cuLibraryUnload(library)))
}

// ---------------------------------------------------------------------------------------
// Initialization and symbol lookup.

pub(crate) unsafe fn cuInit(flags: c_uint) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuInit(flags));
    if !r.is_success() {
        return r;
    }
    match state::get() {
        Enforcement::Ready(_) => r,
        Enforcement::Broken(why) => {
            vlog!(ERROR, "cuInit refused: {why}");
            CUresult::NOT_INITIALIZED
        }
    }
}

/// Replaces `*pfn` (what the real `cuGetProcAddress` returned) by our wrapper where hooked.
unsafe fn patch_proc_address(
    cuda: &Cuda,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: the driver just read `symbol` as a C string and wrote `*pfn`.
    let (name, found) = unsafe { (CStr::from_ptr(symbol), *pfn) };
    let Ok(name) = name.to_str() else { return };
    let ours = crate::interpose::substitute_proc_address(cuda, name, found, version, flags);
    if ours != found {
        vlog!(
            DEBUG,
            "cuGetProcAddress({name}, {version}, {flags}) -> hook"
        );
        // SAFETY: `pfn` is the caller's valid out-pointer.
        unsafe { *pfn = ours };
    }
}

pub(crate) unsafe fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuGetProcAddress(symbol, pfn, cuda_version, flags));
    if r.is_success() {
        // SAFETY: the same pointers the caller gave the driver.
        unsafe { patch_proc_address(cuda, symbol, pfn, cuda_version, flags) };
    }
    r
}

pub(crate) unsafe fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    symbol_status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(
        cuda,
        h.cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, symbol_status)
    );
    if r.is_success() {
        // SAFETY: the same pointers the caller gave the driver.
        unsafe { patch_proc_address(cuda, symbol, pfn, cuda_version, flags) };
    }
    r
}

// ---------------------------------------------------------------------------------------
// Views.

pub(crate) unsafe fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemGetInfo_v2(free, total));
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    let Some(idx) = driver::current_device(cuda).ok().and_then(dev_index) else {
        return r;
    };
    reconcile_if_due(st, cuda, idx);
    // SAFETY: the driver just filled both (it fails on null).
    let (Some(f), Some(t)) = (unsafe { read_back(free) }, unsafe { read_back(total) }) else {
        return r;
    };
    let (f, t) = virtual_mem_info(f as u64, t as u64, st.ledger().usage_for_view(idx));
    // SAFETY: valid out-pointers (checked non-null above).
    unsafe {
        *free = f as usize;
        *total = t as usize;
    }
    r
}

pub(crate) unsafe fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuDeviceTotalMem_v2(bytes, dev));
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    let Some(idx) = dev_index(dev) else { return r };
    // SAFETY: the driver filled it (it fails on null).
    let filled = unsafe { read_back(bytes) };
    if let (Some(limit), Some(t)) = (st.ledger().usage(idx).limit, filled) {
        // SAFETY: valid out-pointer (read back above).
        unsafe { *bytes = (t as u64).min(limit) as usize };
    }
    r
}

/// The usage of the CUDA device an NVML handle names (by UUID), if it is visible to this
/// process.
fn nvml_device_usage(
    st: &Ready,
    nvml: &real::Nvml,
    device: nvmlDevice_t,
) -> Option<vgpu_alloc_core::DeviceUsage> {
    let uuid = driver::nvml_uuid(nvml, device)?;
    let cached = |map: &HashMap<String, i32>| map.get(&uuid).copied();
    let known = st
        .ordinals_by_uuid
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(cached);
    let ordinal = match known {
        Some(ordinal) => ordinal?,
        None => {
            // Built without holding our lock: loading the driver may wait on the loader.
            let map = driver::cuda_ordinals_by_uuid(real::cuda().ok()?);
            let ordinal = cached(&map);
            *st.ordinals_by_uuid
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(map);
            ordinal?
        }
    };
    let idx = dev_index(CUdevice(ordinal))?;
    if let Ok(cuda) = real::cuda() {
        reconcile_if_due(st, cuda, idx);
    }
    Some(st.ledger().usage_for_view(idx))
}

/// One of NVML's memory-info structs, rewritten to the limit's view.
trait NvmlMemoryView: Copy {
    /// `(total, free)` as the driver reported them.
    fn driver_view(&self) -> (u64, u64);
    /// Replace the figures with the virtual `(total, free, used)`.
    fn set_virtual(&mut self, total: u64, free: u64, used: u64);
}

impl NvmlMemoryView for nvmlMemory_t {
    fn driver_view(&self) -> (u64, u64) {
        (self.total, self.free)
    }
    fn set_virtual(&mut self, total: u64, free: u64, used: u64) {
        (self.total, self.free, self.used) = (total, free, used);
    }
}

impl NvmlMemoryView for nvmlMemory_v2_t {
    fn driver_view(&self) -> (u64, u64) {
        (self.total, self.free)
    }
    fn set_virtual(&mut self, total: u64, free: u64, used: u64) {
        (self.total, self.free, self.used) = (total, free, used);
        self.reserved = 0; // total = free + used under the limit
    }
}

type NvmlMemoryFn<T> = unsafe extern "C" fn(nvmlDevice_t, *mut T) -> nvmlReturn_t;

/// Both `nvmlDeviceGetMemoryInfo` versions: forward, then show the limit's view.
///
/// # Safety
/// `memory` as NVML's contract requires (NVML itself rejects null).
unsafe fn nvml_memory_info<T: NvmlMemoryView>(
    device: nvmlDevice_t,
    memory: *mut T,
    real_fn: impl FnOnce(&real::Nvml) -> Option<NvmlMemoryFn<T>>,
) -> nvmlReturn_t {
    let nvml = match real::nvml() {
        Ok(n) => n,
        Err(e) => return e,
    };
    let Some(f) = real_fn(nvml) else {
        return nvmlReturn_t::FUNCTION_NOT_FOUND;
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(device, memory) };
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    // SAFETY: NVML filled it (it fails on null).
    let Some(mut m) = (unsafe { read_back(memory) }) else {
        return r;
    };
    let (total, free) = m.driver_view();
    if let Some((total, free, used)) =
        nvml_device_usage(st, nvml, device).and_then(|u| virtual_nvml_info(total, free, u))
    {
        m.set_virtual(total, free, used);
        // SAFETY: valid out-pointer.
        unsafe { *memory = m };
    }
    r
}

pub(crate) unsafe fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    // SAFETY: the caller's pointer, as NVML's contract requires.
    unsafe { nvml_memory_info(device, memory, |n| n.h.nvmlDeviceGetMemoryInfo) }
}

pub(crate) unsafe fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    // SAFETY: the caller's pointer, as NVML's contract requires.
    unsafe { nvml_memory_info(device, memory, |n| n.h.nvmlDeviceGetMemoryInfo_v2) }
}

// ---------------------------------------------------------------------------------------
// Plain device memory.

pub(crate) unsafe fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    if dptr.is_null() {
        return CUresult::INVALID_VALUE;
    }
    let (ctx, dev) = tri!(driver::current(cuda));
    let Some(idx) = dev_index(dev) else {
        vlog!(
            WARN,
            "device {} is beyond the {MAX_DEVICES} tracked devices: not accounted",
            dev.0
        );
        return call!(cuda, h.cuMemAlloc_v2(dptr, bytesize));
    };
    match with_pool_retry(st, cuda, || {
        st.alloc.allocate(idx, ctx_id(ctx), bytesize as u64)
    }) {
        Ok(a) => {
            // Only allocations that reached the driver (no clock read on the sub-allocated path;
            // a sub-threshold request that fell back to the driver counts as direct).
            if a.kind == AllocationKind::Direct {
                reconcile_if_due(st, cuda, idx);
            }
            // SAFETY: non-null out-pointer (checked above).
            unsafe { ffi::code(write_out(dptr, CUdeviceptr(a.ptr.0))) }
        }
        Err(e) => alloc_err(e),
    }
}

/// Whether `ptr` lies inside one of the sub-allocator's regions (in a chunk that is not a
/// live allocation's base: a double free or an interior pointer). The driver must not see
/// it, or it would free the whole region under the other sub-allocations. One ordered
/// lookup, no copy of the region list.
fn inside_region(st: &Ready, ptr: CUdeviceptr) -> bool {
    st.alloc.region_containing(DevicePtr(ptr.0)).is_some()
}

pub(crate) unsafe fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let cuda = tri!(real::cuda());
    let st = match state::get() {
        Enforcement::Ready(st) if dptr.0 != 0 => st,
        _ => return call!(cuda, h.cuMemFree_v2(dptr)),
    };
    match st.alloc.free(DevicePtr(dptr.0)) {
        Ok(_) => CUresult::SUCCESS,
        Err(FreeError::NotTracked) if inside_region(st, dptr) => {
            vlog!(
                WARN,
                "cuMemFree({:#x}): not a live allocation (double free or interior pointer)",
                dptr.0
            );
            CUresult::INVALID_VALUE
        }
        Err(FreeError::NotTracked) => {
            // Not ours to account (e.g. stream-ordered memory freed synchronously): the
            // driver frees it and answers as it would without vgpu.
            let r = call!(cuda, h.cuMemFree_v2(dptr));
            if r.is_success() && st.pools.is_active() {
                settle_all_pools(st, cuda);
            }
            r
        }
        Err(FreeError::Backend(b)) => CUresult(b.code),
        Err(FreeError::Internal(why)) => {
            vlog!(
                ERROR,
                "internal accounting error freeing {:#x}: {why}",
                dptr.0
            );
            CUresult::UNKNOWN
        }
    }
}

pub(crate) unsafe fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width_in_bytes: usize,
    height: usize,
    element_size_bytes: c_uint,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    let real_call = || {
        call!(
            cuda,
            h.cuMemAllocPitch_v2(dptr, pitch, width_in_bytes, height, element_size_bytes)
        )
    };
    if dptr.is_null() || pitch.is_null() || width_in_bytes == 0 || height == 0 {
        return real_call(); // the driver reports the invalid argument
    }
    let (ctx, dev) = tri!(driver::current(cuda));
    let Some(idx) = dev_index(dev) else {
        return real_call();
    };
    let align = st.config.allocator.align;
    let charge = |bytes: Option<u64>| bytes.and_then(|b| align_up(b, align));
    let requested = (width_in_bytes as u64).saturating_mul(height as u64);
    // Rows are padded to the pitch alignment (512 bytes on current GPUs); charge that
    // estimate up front and correct it with the real pitch.
    let estimate =
        charge(align_up(width_in_bytes as u64, 512).and_then(|w| w.checked_mul(height as u64)));
    let Some(estimate) = estimate else {
        return CUresult::OUT_OF_MEMORY;
    };
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            AllocationKind::Pitched,
            idx,
            ctx_id(ctx),
            requested,
            estimate
        ))
        .map_err(alloc_err)
    );
    let r = real_call();
    if !r.is_success() {
        return r;
    }
    // SAFETY: the driver filled both out-pointers (checked non-null above).
    let (ptr, real_pitch) = unsafe { (*dptr, *pitch) };
    let actual = charge((real_pitch as u64).checked_mul(height as u64)).unwrap_or(u64::MAX);
    let mut pending = pending;
    if let Err(e) = correct_charge(&mut pending, actual) {
        drop(pending);
        let _ = call!(cuda, h.cuMemFree_v2(ptr));
        return alloc_err(e);
    }
    if let Err(e) = pending.commit(ptr.0) {
        commit_err(e, "a pitched allocation");
    }
    reconcile_if_due(st, cuda, idx);
    r
}

/// Change a pending charge to the size the driver really allocated, in place: the estimate
/// and the exact charge are never held together, so an allocation that fits the limit is
/// not refused because its estimate was still charged.
fn correct_charge<B: DeviceBackend, L: UsageLedger>(
    pending: &mut PendingRecord<'_, B, L>,
    actual: u64,
) -> Result<(), AllocError> {
    if pending.accounted() == actual {
        return Ok(());
    }
    pending.resize(actual)
}

pub(crate) unsafe fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    let real_call = || call!(cuda, h.cuMemAllocManaged(dptr, bytesize, flags));
    if !st.config.count_managed || dptr.is_null() || bytesize == 0 {
        return real_call();
    }
    let (ctx, dev) = tri!(driver::current(cuda));
    let Some(idx) = dev_index(dev) else {
        return real_call();
    };
    let Some(charge) = align_up(bytesize as u64, st.config.allocator.align) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            AllocationKind::Managed,
            idx,
            ctx_id(ctx),
            bytesize as u64,
            charge
        ))
        .map_err(alloc_err)
    );
    let r = real_call();
    if r.is_success() {
        // SAFETY: the driver filled the non-null out-pointer.
        if let Err(e) = pending.commit(unsafe { *dptr }.0) {
            commit_err(e, "a managed allocation");
        }
        reconcile_if_due(st, cuda, idx);
    }
    r
}

/// The sub-allocation containing `ptr`, if `ptr` is inside one.
fn suballocation(ptr: CUdeviceptr) -> Option<vgpu_alloc_core::AddressRange> {
    let st = ready_state()?;
    st.alloc
        .containing(DevicePtr(ptr.0))
        .filter(|r| r.kind == AllocationKind::SubAllocated)
}

pub(crate) unsafe fn cuMemGetAddressRange_v2(
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    if let Some(range) = suballocation(dptr) {
        // Both out-pointers are optional in the driver API.
        if !pbase.is_null() {
            // SAFETY: non-null caller out-pointer.
            unsafe { *pbase = CUdeviceptr(range.base.0) };
        }
        if !psize.is_null() {
            // SAFETY: non-null caller out-pointer.
            unsafe { *psize = range.size as usize };
        }
        return CUresult::SUCCESS;
    }
    let cuda = tri!(real::cuda());
    call!(cuda, h.cuMemGetAddressRange_v2(pbase, psize, dptr))
}

/// Writes a sub-allocation's range attribute to `data`; false for other attributes.
///
/// # Safety
/// `data` must be valid for the attribute's type (the driver API contract).
unsafe fn write_range_attribute(
    range: &vgpu_alloc_core::AddressRange,
    attr: CUpointer_attribute,
    data: *mut c_void,
) -> bool {
    if data.is_null() {
        return false;
    }
    match attr {
        // SAFETY: RANGE_START_ADDR writes a CUdeviceptr, RANGE_SIZE a size_t.
        CUpointer_attribute::RANGE_START_ADDR => unsafe {
            data.cast::<CUdeviceptr>().write(CUdeviceptr(range.base.0))
        },
        // SAFETY: as above.
        CUpointer_attribute::RANGE_SIZE => unsafe {
            data.cast::<usize>().write(range.size as usize)
        },
        _ => return false,
    }
    true
}

pub(crate) unsafe fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> CUresult {
    if matches!(
        attribute,
        CUpointer_attribute::RANGE_START_ADDR | CUpointer_attribute::RANGE_SIZE
    ) {
        if let Some(range) = suballocation(ptr) {
            // SAFETY: `data` per the attribute's contract.
            if unsafe { write_range_attribute(&range, attribute, data) } {
                return CUresult::SUCCESS;
            }
        }
    }
    let cuda = tri!(real::cuda());
    call!(cuda, h.cuPointerGetAttribute(data, attribute, ptr))
}

pub(crate) unsafe fn cuPointerGetAttributes(
    num_attributes: c_uint,
    attributes: *mut CUpointer_attribute,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(
        cuda,
        h.cuPointerGetAttributes(num_attributes, attributes, data, ptr)
    );
    if !r.is_success() || attributes.is_null() || data.is_null() {
        return r;
    }
    if let Some(range) = suballocation(ptr) {
        for i in 0..num_attributes as usize {
            // SAFETY: both arrays have `num_attributes` entries (driver contract; the driver
            // just read them).
            let (attr, out) = unsafe { (*attributes.add(i), *data.add(i)) };
            // SAFETY: `out` per the attribute's contract.
            unsafe { write_range_attribute(&range, attr, out) };
        }
    }
    r
}

pub(crate) unsafe fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) -> CUresult {
    if suballocation(dptr).is_some() {
        vlog!(
            ERROR,
            "cuIpcGetMemHandle({:#x}): the pointer is sub-allocated and cannot be shared between processes; \
             run with VGPU_SUBALLOC=0 to give every allocation its own device memory",
            dptr.0
        );
        return CUresult::INVALID_VALUE;
    }
    let cuda = tri!(real::cuda());
    call!(cuda, h.cuIpcGetMemHandle(handle, dptr))
}

// ---------------------------------------------------------------------------------------
// Virtual memory management.

pub(crate) unsafe fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    let real_call = || call!(cuda, h.cuMemCreate(handle, size, prop, flags));
    // SAFETY: `prop` is null or a valid CUmemAllocationProp (driver contract).
    let Some(p) = (unsafe { read_in(prop) }) else {
        return real_call();
    };
    if p.location.type_ != CUmemLocationType::DEVICE || handle.is_null() || size == 0 {
        return real_call(); // host memory is not device memory; errors are the driver's
    }
    // On the handle's own device, which need not be the current one.
    let Some(idx) = dev_index(CUdevice(p.location.id)) else {
        return real_call();
    };
    let gran = driver::granularity(cuda, &p).unwrap_or(1).max(1);
    let Some(charge) = (size as u64).div_ceil(gran).checked_mul(gran) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            AllocationKind::VmmHandle,
            idx,
            NO_CONTEXT,
            size as u64,
            charge
        ))
        .map_err(alloc_err)
    );
    let r = real_call();
    if r.is_success() {
        // SAFETY: the driver filled the non-null out-pointer.
        if let Err(e) = pending.commit(unsafe { *handle }.0) {
            commit_err(e, "a cuMemCreate handle");
        }
        reconcile_if_due(st, cuda, idx);
    }
    r
}

pub(crate) unsafe fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemRelease(handle));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        let mut refs = st.vmm_extra_refs.lock().unwrap_or_else(|e| e.into_inner());
        match refs.get_mut(&handle.0) {
            // A reference from cuMemRetainAllocationHandle: the allocation lives on.
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                refs.remove(&handle.0);
            }
            None => {
                drop(refs);
                let _ = st.alloc.release_record(AllocationKind::VmmHandle, handle.0);
            }
        }
    }
    r
}

pub(crate) unsafe fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemRetainAllocationHandle(handle, addr));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        // SAFETY: the driver filled the out-pointer (it fails on null).
        if let Some(h) = unsafe { read_back(handle) } {
            // The same handle value as cuMemCreate returned, one reference more.
            if st.alloc.lookup(AllocationKind::VmmHandle, h.0).is_some() {
                *st.vmm_extra_refs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(h.0)
                    .or_insert(0) += 1;
            }
        }
    }
    r
}

// ---------------------------------------------------------------------------------------
// Stream-ordered allocation and pools.

/// Re-measures one pool and settles its charge.
fn settle_pool(st: &Ready, cuda: &Cuda, pool: CUmemoryPool, device: DeviceIndex, tentative: u64) {
    let measured = match driver::pool_attr(cuda, pool, CUmemPool_attribute::RESERVED_MEM_CURRENT) {
        Ok(m) => m,
        // Cannot measure: keep what was charged, plus the tentative reservation.
        Err(_) => st.pools.get(pool as usize).map_or(0, |m| m.accounted) + tentative,
    };
    let m = st
        .pools
        .settle(st.ledger(), pool as usize, device, measured, tentative);
    if m.shortfall > 0 {
        vlog!(
            WARN,
            "device {}: memory pool {:#x} holds {} bytes more than the limit allows; charged when room appears",
            m.device,
            pool as usize,
            m.shortfall
        );
    }
}

/// Re-measures every tracked pool (sync points, frees, before refusing an allocation).
fn settle_all_pools(st: &Ready, cuda: &Cuda) {
    for key in st.pools.keys() {
        if let Some(m) = st.pools.get(key) {
            settle_pool(st, cuda, key as CUmemoryPool, m.device, 0);
        }
    }
}

fn pool_device(st: &Ready, cuda: &Cuda, pool: CUmemoryPool) -> Option<DeviceIndex> {
    if let Some(m) = st.pools.get(pool as usize) {
        return Some(m.device);
    }
    driver::find_pool_device(cuda, pool).and_then(dev_index)
}

/// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` (`pool` given) and their `_ptsz` forms:
/// `real` performs the call.
fn alloc_async(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    per_thread: bool,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    if dptr.is_null() || bytesize == 0 {
        return real();
    }
    let target = match pool {
        Some(p) => pool_device(st, cuda, p).map(|d| (p, d)),
        None => {
            let Some(idx) = driver::stream_device(cuda, stream).ok().and_then(|dev| {
                let idx = dev_index(dev)?;
                match driver::device_mem_pool(cuda, dev) {
                    Ok(p) => Some(Ok((p, idx))),
                    Err(_) => Some(Err(idx)),
                }
            }) else {
                return real(); // the driver reports the bad stream
            };
            match idx {
                Ok(t) => Some(t),
                // The pool cannot be named (a driver without cuDeviceGetMemPool): charge the
                // allocation itself, so it is still counted and released on free.
                Err(idx) => return alloc_async_unpooled(st, cuda, dptr, bytesize, idx, real),
            }
        }
    };
    let Some((pool, idx)) = target else {
        vlog!(
            DEBUG,
            "stream-ordered allocation from an untracked (host) pool: passed through"
        );
        return real();
    };
    if driver::stream_capturing(cuda, stream, per_thread) {
        // Becomes a graph memory node, charged when the graph is launched or uploaded (graph
        // memory is measured from now on). No pool query: during a global-mode capture
        // cuMemPoolGetAttribute invalidates the capture (seen on the H200, GPU run 2).
        st.graph_mem_possible.store(true, Ordering::Relaxed);
        return match refuse_unless_it_fits(st, idx, bytesize as u64) {
            Ok(()) => real(),
            Err(r) => r,
        };
    }
    // The part of the request the pool cannot serve from memory it already holds.
    let reserved =
        driver::pool_attr(cuda, pool, CUmemPool_attribute::RESERVED_MEM_CURRENT).unwrap_or(0);
    let used =
        driver::pool_attr(cuda, pool, CUmemPool_attribute::USED_MEM_CURRENT).unwrap_or(reserved);
    let need = (bytesize as u64).saturating_sub(reserved.saturating_sub(used));
    let Some(need) = align_up(need, POOL_GRANULE) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let reserve = || {
        st.pools
            .reserve_tentative(st.ledger(), idx, need)
            .map_err(AllocError::OutOfMemory)
    };
    let tentative = tri!(with_pool_retry(st, cuda, reserve).map_err(alloc_err));
    let r = real();
    if !r.is_success() {
        st.pools.cancel(st.ledger(), idx, tentative);
        return r;
    }
    settle_pool(st, cuda, pool, idx, tentative);
    reconcile_if_due(st, cuda, idx);
    r
}

/// Stream-ordered allocation charged per allocation (rounded to the pool granule), for when
/// the pool cannot be measured.
fn alloc_async_unpooled(
    st: &Ready,
    cuda: &Cuda,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    idx: DeviceIndex,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(charge) = align_up(bytesize as u64, POOL_GRANULE) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let ctx = driver::current_context(cuda).unwrap_or(std::ptr::null_mut());
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            AllocationKind::PoolAsync,
            idx,
            ctx_id(ctx),
            bytesize as u64,
            charge
        ))
        .map_err(alloc_err)
    );
    let r = real();
    if r.is_success() {
        // SAFETY: the driver filled the non-null out-pointer.
        if let Err(e) = pending.commit(unsafe { *dptr }.0) {
            commit_err(e, "a stream-ordered allocation");
        }
    }
    r
}

pub(crate) unsafe fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, None, stream, false, || {
        call!(cuda, h.cuMemAllocAsync(dptr, bytesize, stream))
    })
}

pub(crate) unsafe fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, None, stream, true, || {
        call!(cuda, h.cuMemAllocAsync_ptsz(dptr, bytesize, stream))
    })
}

pub(crate) unsafe fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, Some(pool), stream, false, || {
        call!(
            cuda,
            h.cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream)
        )
    })
}

pub(crate) unsafe fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, Some(pool), stream, true, || {
        call!(
            cuda,
            h.cuMemAllocFromPoolAsync_ptsz(dptr, bytesize, pool, stream)
        )
    })
}

/// `cuMemFreeAsync[_ptsz]`: frees whatever it is given. Memory from the synchronous
/// allocators is released from our table; sub-allocated chunks are reused only after the
/// stream has reached the free (we synchronize it, since the region stays allocated).
fn free_async(
    dptr: CUdeviceptr,
    stream: CUstream,
    real: impl FnOnce() -> CUresult,
    sync: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(st) = ready_state().filter(|_| dptr.0 != 0) else {
        return real();
    };
    let Some(range) = st
        .alloc
        .containing(DevicePtr(dptr.0))
        .filter(|r| r.base.0 == dptr.0)
    else {
        return real(); // pool memory (charged per pool) or unknown: the driver decides
    };
    if range.kind == AllocationKind::SubAllocated {
        let r = sync();
        if !r.is_success() {
            return r;
        }
        return match st.alloc.free(DevicePtr(dptr.0)) {
            Ok(_) | Err(FreeError::NotTracked) => CUresult::SUCCESS,
            Err(FreeError::Backend(b)) => CUresult(b.code),
            Err(FreeError::Internal(why)) => {
                vlog!(
                    ERROR,
                    "internal accounting error freeing {:#x}: {why}",
                    dptr.0
                );
                CUresult::UNKNOWN
            }
        };
    }
    let _ = stream;
    let r = real();
    if r.is_success() {
        let _ = st.alloc.release_record(range.kind, dptr.0);
    }
    r
}

pub(crate) unsafe fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    free_async(
        dptr,
        stream,
        || call!(cuda, h.cuMemFreeAsync(dptr, stream)),
        || call!(cuda, h.cuStreamSynchronize(stream)),
    )
}

pub(crate) unsafe fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    free_async(
        dptr,
        stream,
        || call!(cuda, h.cuMemFreeAsync_ptsz(dptr, stream)),
        || call!(cuda, h.cuStreamSynchronize_ptsz(stream)),
    )
}

pub(crate) unsafe fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemPoolCreate(pool, props));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        // SAFETY: the driver read `props` and wrote `*pool`.
        if let (Some(p), Some(handle)) = (unsafe { read_in(props) }, unsafe { read_back(pool) }) {
            if p.location.type_ == CUmemLocationType::DEVICE {
                if let Some(idx) = dev_index(CUdevice(p.location.id)) {
                    st.pools.register(handle as usize, idx);
                }
            }
        }
    }
    r
}

pub(crate) unsafe fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemPoolDestroy(pool));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        st.pools.remove(st.ledger(), pool as usize);
    }
    r
}

pub(crate) unsafe fn cuMemPoolTrimTo(pool: CUmemoryPool, min_bytes_to_keep: usize) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemPoolTrimTo(pool, min_bytes_to_keep));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        if let Some(m) = st.pools.get(pool as usize) {
            settle_pool(st, cuda, pool, m.device, 0);
        }
    }
    r
}

/// After a sync point: pools and graph memory may have given memory back.
fn after_sync(cuda: &Cuda) {
    if let Some(st) = ready_state() {
        if st.pools.is_active() {
            settle_all_pools(st, cuda);
        }
    }
}

pub(crate) unsafe fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuStreamSynchronize(stream));
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuStreamSynchronize_ptsz(stream));
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuCtxSynchronize() -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuCtxSynchronize());
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuCtxSynchronize_v2(ctx));
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuEventSynchronize(event: CUevent) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuEventSynchronize(event));
    after_sync(cuda);
    r
}

// ---------------------------------------------------------------------------------------
// Arrays.

/// Creates an array-like object of `bytes`, charged as `kind` in the current context.
fn create_array(
    kind: AllocationKind,
    bytes: Option<u64>,
    real: impl FnOnce() -> CUresult,
    handle: impl FnOnce() -> u64,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    let Some(bytes) = bytes else { return real() }; // no descriptor: the driver reports it
    if bytes == 0 {
        return real(); // sparse / deferred mapping: paid by cuMemCreate
    }
    let Ok((ctx, dev)) = driver::current(cuda) else {
        return real();
    };
    let Some(idx) = dev_index(dev) else {
        return real();
    };
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            kind,
            idx,
            ctx_id(ctx),
            bytes,
            bytes
        ))
        .map_err(alloc_err)
    );
    let r = real();
    if r.is_success() {
        if let Err(e) = pending.commit(handle()) {
            commit_err(e, "an array");
        }
        reconcile_if_due(st, cuda, idx);
    }
    r
}

fn destroy_array(kind: AllocationKind, key: u64, r: CUresult) -> CUresult {
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        let _ = st.alloc.release_record(kind, key);
    }
    r
}

pub(crate) unsafe fn cuArrayCreate_v2(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes = unsafe { read_in(desc) }.map(|d| array2d_bytes(&d).unwrap_or(u64::MAX));
    if handle.is_null() {
        return call!(cuda, h.cuArrayCreate_v2(handle, desc));
    }
    // SAFETY: the driver filled the non-null out-pointer on success.
    create_array(
        AllocationKind::Array,
        bytes,
        || call!(cuda, h.cuArrayCreate_v2(handle, desc)),
        || unsafe { *handle } as u64,
    )
}

pub(crate) unsafe fn cuArray3DCreate_v2(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes = unsafe { read_in(desc) }.map(|d| array3d_bytes(&d).unwrap_or(u64::MAX));
    if handle.is_null() {
        return call!(cuda, h.cuArray3DCreate_v2(handle, desc));
    }
    // SAFETY: the driver filled the non-null out-pointer on success.
    create_array(
        AllocationKind::Array,
        bytes,
        || call!(cuda, h.cuArray3DCreate_v2(handle, desc)),
        || unsafe { *handle } as u64,
    )
}

pub(crate) unsafe fn cuArrayDestroy(handle: CUarray) -> CUresult {
    let cuda = tri!(real::cuda());
    destroy_array(
        AllocationKind::Array,
        handle as u64,
        call!(cuda, h.cuArrayDestroy(handle)),
    )
}

pub(crate) unsafe fn cuMipmappedArrayCreate(
    handle: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    num_levels: c_uint,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes =
        unsafe { read_in(desc) }.map(|d| mipmapped_bytes(&d, num_levels).unwrap_or(u64::MAX));
    if handle.is_null() {
        return call!(cuda, h.cuMipmappedArrayCreate(handle, desc, num_levels));
    }
    create_array(
        AllocationKind::MipmappedArray,
        bytes,
        || call!(cuda, h.cuMipmappedArrayCreate(handle, desc, num_levels)),
        // SAFETY: the driver filled the non-null out-pointer on success.
        || unsafe { *handle } as u64,
    )
}

pub(crate) unsafe fn cuMipmappedArrayDestroy(handle: CUmipmappedArray) -> CUresult {
    let cuda = tri!(real::cuda());
    destroy_array(
        AllocationKind::MipmappedArray,
        handle as u64,
        call!(cuda, h.cuMipmappedArrayDestroy(handle)),
    )
}

// ---------------------------------------------------------------------------------------
// Contexts: measured as the growth of the device's used memory (NVML, which needs no
// context) across the creation. Just before it, the SM limiter records the device's power
// (`sm_limit::context_creating`: once per device, with an SM limit only).

/// What NVML says around a context creation: this process's used memory on the device and
/// the device's used memory.
#[derive(Debug, Clone, Copy)]
struct UsedSample {
    process: ProcessUsage,
    device: Option<u64>,
}

fn sample_used(st: &Ready, cuda: &Cuda, dev: CUdevice) -> UsedSample {
    UsedSample {
        process: process_used(st, cuda, dev),
        device: driver::nvml_used_bytes(cuda, dev),
    }
}

/// The memory a context creation took: the growth of this process's own used memory when
/// NVML lists the process afterwards (before, a process without a context is not listed:
/// 0), so another process allocating meanwhile does not inflate it; else the growth of the
/// device's used memory. `None` when neither was measured.
fn context_growth(before: UsedSample, after: UsedSample) -> Option<u64> {
    let before_process = match before.process {
        ProcessUsage::Used(u) => Some(u),
        ProcessUsage::NotListed { .. } => Some(0),
        ProcessUsage::Unavailable => None,
    };
    match (before_process, after.process) {
        (Some(b), ProcessUsage::Used(a)) => Some(measured_growth(b, a)),
        _ => before
            .device
            .zip(after.device)
            .map(|(b, a)| measured_growth(b, a)),
    }
}

/// Charges `bytes` of context memory for `ctx`; on refusal `undo` destroys the context.
fn charge_context(
    st: &Ready,
    idx: DeviceIndex,
    ctx: CUcontext,
    bytes: u64,
    undo: impl FnOnce(),
) -> CUresult {
    vlog!(
        INFO,
        "device {idx}: context {:#x} takes {bytes} bytes",
        ctx as usize
    );
    match st
        .alloc
        .begin_record(AllocationKind::Context, idx, ctx_id(ctx), bytes, bytes)
    {
        Ok(p) => {
            if let Err(e) = p.commit(ctx as u64) {
                commit_err(e, "a context");
            }
            st.residual.context_created(ctx as usize, idx);
            CUresult::SUCCESS
        }
        Err(e) => {
            undo();
            alloc_err(e)
        }
    }
}

pub(crate) unsafe fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    let real_call = || call!(cuda, h.cuDevicePrimaryCtxRetain(pctx, dev));
    let (Some(st), Some(idx)) = (ready_state(), dev_index(dev)) else {
        return real_call();
    };
    let creating = !driver::primary_ctx_active(cuda, dev).unwrap_or(true);
    let before = creating.then(|| sample_used(st, cuda, dev));
    if creating {
        sm_limit::context_creating(idx.0 as usize);
    }
    let r = real_call();
    if !r.is_success() || pctx.is_null() {
        return r;
    }
    if !creating {
        return r;
    }
    // SAFETY: the driver filled the non-null out-pointer.
    let ctx = unsafe { *pctx };
    // Measured before taking our lock (NVML calls may enter the loader).
    let after = before.map(|_| sample_used(st, cuda, dev));
    let mut primary = st.primary.lock().unwrap_or_else(|e| e.into_inner());
    if primary.contains_key(&dev.0) {
        return r; // another thread created and charged it
    }
    let Some(bytes) = before.zip(after).and_then(|(b, a)| context_growth(b, a)) else {
        vlog!(
            INFO,
            "device {idx}: context memory not measured (NVML unavailable)"
        );
        return r;
    };
    let code = charge_context(st, idx, ctx, bytes, || {
        let _ = call!(cuda, h.cuDevicePrimaryCtxRelease_v2(dev));
    });
    if code.is_success() {
        primary.insert(dev.0, ctx as usize);
        drop(primary);
        // Anything else the driver took for this process meanwhile.
        st.residual.ran_now();
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
    }
    code
}

/// After a primary context release or reset: if it is gone, so is everything in it.
fn primary_gone(cuda: &Cuda, dev: CUdevice, r: CUresult) -> CUresult {
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    if driver::primary_ctx_active(cuda, dev).unwrap_or(true) {
        return r;
    }
    driver::contexts_changed();
    let ctx = st
        .primary
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&dev.0);
    if let Some(ctx) = ctx {
        st.residual.context_gone(ctx);
        let released = st.alloc.release_context(ContextId(ctx as u64));
        vlog!(
            DEBUG,
            "device {}: primary context gone, released {} bytes",
            dev.0,
            released.released
        );
    }
    // Its code went with it.
    after_code_unload(r)
}

pub(crate) unsafe fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_gone(cuda, dev, call!(cuda, h.cuDevicePrimaryCtxRelease(dev)))
}

pub(crate) unsafe fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_gone(cuda, dev, call!(cuda, h.cuDevicePrimaryCtxRelease_v2(dev)))
}

/// Reset destroys every allocation of the primary context (it stays retained).
fn primary_reset(dev: CUdevice, r: CUresult) -> CUresult {
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        driver::contexts_changed();
        let ctx = st
            .primary
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&dev.0);
        if let Some(ctx) = ctx {
            st.residual.context_gone(ctx);
            st.alloc.release_context(ContextId(ctx as u64));
        }
    }
    after_code_unload(r)
}

pub(crate) unsafe fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_reset(dev, call!(cuda, h.cuDevicePrimaryCtxReset(dev)))
}

pub(crate) unsafe fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_reset(dev, call!(cuda, h.cuDevicePrimaryCtxReset_v2(dev)))
}

/// `cuCtxCreate*`: measure, create, charge.
fn create_context(
    cuda: &Cuda,
    pctx: *mut CUcontext,
    dev: CUdevice,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let (Some(st), Some(idx)) = (ready_state(), dev_index(dev)) else {
        return real();
    };
    let before = sample_used(st, cuda, dev);
    sm_limit::context_creating(idx.0 as usize);
    let r = real();
    if !r.is_success() || pctx.is_null() {
        return r;
    }
    // SAFETY: the driver filled the non-null out-pointer.
    let ctx = unsafe { *pctx };
    let Some(bytes) = context_growth(before, sample_used(st, cuda, dev)) else {
        vlog!(
            INFO,
            "device {idx}: context memory not measured (NVML unavailable)"
        );
        return r;
    };
    let code = charge_context(st, idx, ctx, bytes, || {
        let _ = call!(cuda, h.cuCtxDestroy_v2(ctx));
    });
    if code.is_success() {
        st.residual.ran_now();
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
    }
    code
}

pub(crate) unsafe fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let cuda = tri!(real::cuda());
    create_context(cuda, pctx, dev, || {
        call!(cuda, h.cuCtxCreate_v2(pctx, flags, dev))
    })
}

pub(crate) unsafe fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: CUexecAffinityParamPtr,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let cuda = tri!(real::cuda());
    create_context(cuda, pctx, dev, || {
        call!(cuda, h.cuCtxCreate_v3(pctx, params, num_params, flags, dev))
    })
}

pub(crate) unsafe fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: CUctxCreateParamsPtr,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let cuda = tri!(real::cuda());
    create_context(cuda, pctx, dev, || {
        call!(cuda, h.cuCtxCreate_v4(pctx, params, flags, dev))
    })
}

fn context_destroyed(ctx: CUcontext, r: CUresult) -> CUresult {
    if r.is_success() {
        driver::contexts_changed();
    }
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        st.residual.context_gone(ctx as usize);
        st.alloc.release_context(ctx_id(ctx));
    }
    after_code_unload(r)
}

pub(crate) unsafe fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    let cuda = tri!(real::cuda());
    context_destroyed(ctx, call!(cuda, h.cuCtxDestroy(ctx)))
}

pub(crate) unsafe fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let cuda = tri!(real::cuda());
    context_destroyed(ctx, call!(cuda, h.cuCtxDestroy_v2(ctx)))
}

// ---------------------------------------------------------------------------------------
// Graph memory: graphs reserve their memory at launch, from a per-device graph heap we
// measure (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) after launches and trims.

fn settle_graph(st: &Ready, cuda: &Cuda, dev: CUdevice) {
    let Some(idx) = dev_index(dev) else { return };
    let Ok(measured) = driver::graph_mem_reserved(cuda, dev) else {
        return;
    };
    if measured == 0 && st.graph.get(dev.0).is_none() {
        return;
    }
    let m = st.graph.settle(st.ledger(), dev.0, idx, measured, 0);
    if m.shortfall > 0 {
        vlog!(
            WARN,
            "device {idx}: graph memory holds {} bytes more than the limit allows",
            m.shortfall
        );
    }
}

/// Refuses (with the usual log line) an allocation that alone cannot fit what is left of the
/// limit, for memory charged later by measurement (graph memory nodes, captured allocations).
fn refuse_unless_it_fits(st: &Ready, idx: DeviceIndex, bytes: u64) -> Result<(), CUresult> {
    st.ledger()
        .try_reserve(idx, UsageClass::Data, bytes)
        .map_err(|oom| log_oom(&oom))?;
    st.ledger().release(idx, UsageClass::Data, bytes);
    Ok(())
}

pub(crate) unsafe fn cuGraphAddMemAllocNode(
    node: *mut CUgraphNode,
    graph: CUgraph,
    dependencies: *const CUgraphNode,
    num_dependencies: usize,
    params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let real_call = || {
        call!(
            cuda,
            h.cuGraphAddMemAllocNode(node, graph, dependencies, num_dependencies, params)
        )
    };
    let Some(st) = ready_state() else {
        return real_call();
    };
    // SAFETY: `params` is null or valid (driver contract).
    if let Some(p) = unsafe { read_in(params) } {
        let loc = p.poolProps.location;
        if let Some(idx) =
            dev_index(CUdevice(loc.id)).filter(|_| loc.type_ == CUmemLocationType::DEVICE)
        {
            if let Err(r) = refuse_unless_it_fits(st, idx, p.bytesize as u64) {
                return r;
            }
        }
    }
    let r = real_call();
    if r.is_success() {
        st.graph_mem_possible.store(true, Ordering::Relaxed);
    }
    r
}

pub(crate) unsafe fn cuDeviceGraphMemTrim(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuDeviceGraphMemTrim(dev));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        settle_graph(st, cuda, dev);
    }
    r
}

pub(crate) unsafe fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuGraphUpload(exec, stream));
    after_graph_launch(cuda, stream, r)
}

pub(crate) unsafe fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuGraphUpload_ptsz(exec, stream));
    after_graph_launch(cuda, stream, r)
}

// ---------------------------------------------------------------------------------------
// Launches.

/// Runs a launch with the SM limiter around it when one is configured; without one this is
/// a single relaxed load and the real call.
#[inline(always)]
fn launch(
    cuda: &Cuda,
    stream: impl FnOnce() -> CUstream,
    kind: LaunchKind,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    if !sm_limit::enabled() {
        return real();
    }
    launch_limited(cuda, stream(), kind, real)
}

#[cold]
fn launch_limited(
    cuda: &Cuda,
    stream: CUstream,
    kind: LaunchKind,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(idx) = driver::stream_device(cuda, stream).ok().and_then(dev_index) else {
        return real();
    };
    tri!(sm_limit::before_launch(idx, stream, kind));
    let r = real();
    sm_limit::after_launch(idx, stream, kind, r);
    r
}

pub(crate) unsafe fn cuLaunchKernel(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || stream,
        LaunchKind::Kernel,
        || {
            call!(
                cuda,
                h.cuLaunchKernel(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params,
                    extra
                )
            )
        },
    )
}

pub(crate) unsafe fn cuLaunchKernel_ptsz(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || per_thread(stream),
        LaunchKind::Kernel,
        || {
            call!(
                cuda,
                h.cuLaunchKernel_ptsz(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params,
                    extra
                )
            )
        },
    )
}

/// The stream a `_ptsz` entry point runs on: the null stream there is the calling thread's
/// default stream, which the limiter must name as `CU_STREAM_PER_THREAD` to record its events
/// on the same stream.
fn per_thread(stream: CUstream) -> CUstream {
    if stream.is_null() {
        2usize as CUstream
    } else {
        stream
    }
}

/// The stream of a `CUlaunchConfig` (null config: the default stream; the driver reports it).
///
/// # Safety
/// `config` is null or valid (driver contract).
unsafe fn config_stream(config: *const CUlaunchConfig) -> CUstream {
    // SAFETY: per this function's contract.
    unsafe { read_in(config) }.map_or(std::ptr::null_mut(), |c| c.hStream)
}

pub(crate) unsafe fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    f: CUfunction,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `config` per the driver contract.
    launch(
        cuda,
        || unsafe { config_stream(config) },
        LaunchKind::KernelEx,
        || call!(cuda, h.cuLaunchKernelEx(config, f, kernel_params, extra)),
    )
}

pub(crate) unsafe fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `config` per the driver contract.
    launch(
        cuda,
        || per_thread(unsafe { config_stream(config) }),
        LaunchKind::KernelEx,
        || {
            call!(
                cuda,
                h.cuLaunchKernelEx_ptsz(config, f, kernel_params, extra)
            )
        },
    )
}

pub(crate) unsafe fn cuLaunchCooperativeKernel(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || stream,
        LaunchKind::Cooperative,
        || {
            call!(
                cuda,
                h.cuLaunchCooperativeKernel(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params
                )
            )
        },
    )
}

pub(crate) unsafe fn cuLaunchCooperativeKernel_ptsz(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || per_thread(stream),
        LaunchKind::Cooperative,
        || {
            call!(
                cuda,
                h.cuLaunchCooperativeKernel_ptsz(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params
                )
            )
        },
    )
}

/// After a graph launch or upload: graphs with memory nodes reserve device memory now.
fn after_graph_launch(cuda: &Cuda, stream: CUstream, r: CUresult) -> CUresult {
    if r.is_success() {
        if let Some(st) = ready_state().filter(|st| st.graph_mem_possible.load(Ordering::Relaxed)) {
            if let Ok(dev) = driver::stream_device(cuda, stream) {
                settle_graph(st, cuda, dev);
            }
        }
    }
    r
}

pub(crate) unsafe fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = launch(
        cuda,
        || stream,
        LaunchKind::Graph,
        || call!(cuda, h.cuGraphLaunch(exec, stream)),
    );
    after_graph_launch(cuda, stream, r)
}

pub(crate) unsafe fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = launch(
        cuda,
        || per_thread(stream),
        LaunchKind::Graph,
        || call!(cuda, h.cuGraphLaunch_ptsz(exec, stream)),
    );
    after_graph_launch(cuda, stream, r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_alloc_core::{Allocator, AllocatorConfig, InMemoryLedger, MockBackend};

    #[test]
    fn a_context_is_measured_by_the_process_own_growth_when_nvml_lists_it() {
        let sample = |process, device| UsedSample { process, device };
        const M: u64 = 1 << 20;
        // Not listed before (no context yet), listed after: per-process growth, even though
        // another process took 1 GiB of the device meanwhile.
        let b = sample(ProcessUsage::NotListed { listed: 3 }, Some(10 * M));
        let a = sample(ProcessUsage::Used(500 * M), Some(1534 * M));
        assert_eq!(context_growth(b, a), Some(500 * M));
        // A second context: growth of the process's figure.
        let b = sample(ProcessUsage::Used(500 * M), Some(1534 * M));
        let a = sample(ProcessUsage::Used(800 * M), Some(1834 * M));
        assert_eq!(context_growth(b, a), Some(300 * M));
        // Not listed after (a PID namespace NVML does not see): the device's growth.
        let b = sample(ProcessUsage::NotListed { listed: 0 }, Some(10 * M));
        let a = sample(ProcessUsage::NotListed { listed: 1 }, Some(510 * M));
        assert_eq!(context_growth(b, a), Some(500 * M));
        // Nothing measurable.
        let none = sample(ProcessUsage::Unavailable, None);
        assert_eq!(context_growth(none, none), None);
    }

    /// A pitched allocation whose estimate and real size together exceed the limit, while
    /// either alone fits: correcting the charge must succeed and leave only the real size
    /// charged (taking the exact charge before dropping the estimate gave a false OOM).
    #[test]
    fn a_pitched_charge_is_corrected_in_place_near_the_limit() {
        let mut limits = [None; MAX_DEVICES];
        limits[0] = Some(100 << 20);
        let a = Allocator::new(
            AllocatorConfig::default(),
            MockBackend::new(),
            InMemoryLedger::new(limits),
        )
        .unwrap();
        let (dev, ctx) = (DeviceIndex(0), ContextId(1));
        let mut pending = a
            .begin_record(AllocationKind::Pitched, dev, ctx, 60 << 20, 60 << 20)
            .unwrap();
        correct_charge(&mut pending, 70 << 20).unwrap();
        assert_eq!(a.usage(dev).used, 70 << 20, "only the real size is charged");
        pending.commit(0x7000_0000).unwrap();
        assert_eq!(a.usage(dev).used, 70 << 20);
        let mut too_big = a
            .begin_record(AllocationKind::Pitched, dev, ctx, 20 << 20, 20 << 20)
            .unwrap();
        assert!(matches!(
            correct_charge(&mut too_big, 40 << 20),
            Err(AllocError::OutOfMemory(_))
        ));
        assert_eq!(
            a.usage(dev).used,
            90 << 20,
            "a refused correction keeps the estimate"
        );
        drop(too_big);
        assert_eq!(a.usage(dev).used, 70 << 20);
    }
}
