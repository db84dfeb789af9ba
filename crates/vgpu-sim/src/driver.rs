//! The exported CUDA driver API: pointer translation around [`crate::state::Sim`].
//!
//! Every export runs inside `entry`: the driver must be initialized (except for the few
//! functions real drivers answer before `cuInit`), injected faults apply, and a panic becomes
//! `CUDA_ERROR_UNKNOWN` instead of unwinding into C.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};

use vgpu_cuda_abi::{
    CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUDA_MEM_ALLOC_NODE_PARAMS, CUarray, CUcontext,
    CUdevice, CUdeviceptr, CUdriverProcAddressQueryResult, CUevent, CUfunction, CUgraph,
    CUgraphExec, CUgraphMem_attribute, CUgraphNode, CUipcMemHandle, CUlaunchConfig,
    CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemPool_attribute, CUmemPoolProps, CUmemoryPool,
    CUmipmappedArray, CUmodule, CUpointer_attribute, CUresult, CUstream, CUuuid, c_char, c_int,
    c_uint, c_void,
};

use crate::codes::*;
use crate::state::{
    ArrayDesc, CuResult, Kernel, Launch, PtrAttr, Sim, global, handle, inited, tag,
};

/// Writes an out-parameter, rejecting null with `CUDA_ERROR_INVALID_VALUE`.
macro_rules! out {
    ($p:expr, $v:expr) => {{
        let p = $p;
        if p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let v = $v;
        // SAFETY: a non-null out-parameter the caller passed; the driver API requires it to be
        // valid for one write of its type.
        unsafe { p.write(v) };
    }};
}

/// Reads an in-parameter struct, rejecting null with `CUDA_ERROR_INVALID_VALUE`.
macro_rules! inp {
    ($p:expr) => {{
        let p = $p;
        if p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a non-null in-parameter the caller passed; the driver API requires it to
        // point to a valid value of its type.
        unsafe { p.read() }
    }};
}

/// Reads a NUL-terminated string parameter.
macro_rules! cstr {
    ($p:expr) => {{
        let p = $p;
        if p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a non-null C string the caller passed (NUL-terminated by the API contract).
        unsafe { CStr::from_ptr(p) }
            .to_str()
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?
    }};
}

/// Runs one entry point: initialization check, tracing, fault injection, panic barrier.
pub(crate) fn entry(
    name: &'static str,
    alloc: bool,
    f: impl FnOnce(&'static Sim) -> CuResult<()>,
) -> CUresult {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let s = inited()?;
        if s.cfg.trace {
            eprintln!("vgpu-sim: {name}");
        }
        s.fault(name, alloc)?;
        f(s)
    }));
    CUresult(match r {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(c)) => c,
        Err(_) => CUDA_ERROR_UNKNOWN,
    })
}

/// Like [`entry`] for functions that work before `cuInit`.
fn entry_pre(name: &'static str, f: impl FnOnce() -> CuResult<()>) -> CUresult {
    let r = catch_unwind(AssertUnwindSafe(|| {
        if let Ok(s) = global() {
            s.fault(name, false)?;
        }
        f()
    }));
    CUresult(match r {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(c)) => c,
        Err(_) => CUDA_ERROR_UNKNOWN,
    })
}

fn hv<T>(p: *mut T) -> u64 {
    p as usize as u64
}

fn hp<T>(v: u64) -> *mut T {
    v as usize as *mut T
}

/// Declares exported driver functions. `alloc` marks calls the `alloc` fault applies to.
macro_rules! exports {
    ($( $name:ident ( $($a:ident : $t:ty),* ) $alloc:literal |$s:ident| $body:block )*) => {$(
        #[doc = concat!("The simulated driver's `", stringify!($name), "`.")]
        ///
        /// # Safety
        /// Pointer arguments as the CUDA driver API requires.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> CUresult {
            entry(stringify!($name), $alloc, |$s| $body)
        }
    )*};
}

/// Declares a legacy-stream export and its per-thread-default-stream twin; `$pt` tells the
/// body which one runs.
macro_rules! exports_pt {
    ($( $name:ident / $ptname:ident ( $($a:ident : $t:ty),* ) $alloc:literal |$s:ident, $pt:ident| $body:block )*) => {$(
        #[doc = concat!("The simulated driver's `", stringify!($name), "`.")]
        ///
        /// # Safety
        /// Pointer arguments as the CUDA driver API requires.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> CUresult {
            entry(stringify!($name), $alloc, |$s| { let $pt = false; $body })
        }
        #[doc = concat!("The simulated driver's `", stringify!($ptname), "` (per-thread default stream).")]
        ///
        /// # Safety
        /// Pointer arguments as the CUDA driver API requires.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $ptname($($a: $t),*) -> CUresult {
            entry(stringify!($ptname), $alloc, |$s| { let $pt = true; $body })
        }
    )*};
}

// ----- before cuInit -----

/// The simulated driver's `cuInit`.
///
/// # Safety
/// None beyond the C ABI.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry_pre("cuInit", || global()?.init(flags))
}

/// The simulated driver's `cuDriverGetVersion`.
///
/// # Safety
/// `version` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    entry_pre("cuDriverGetVersion", || {
        out!(version, global()?.cfg.driver_version);
        Ok(())
    })
}

/// The simulated driver's `cuGetErrorName`: unknown codes give `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `p` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, p: *mut *const c_char) -> CUresult {
    entry_pre("cuGetErrorName", || match cuda_error(code.0) {
        Some((name, _)) => {
            out!(p, name.as_ptr().cast());
            Ok(())
        }
        None => {
            out!(p, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// The simulated driver's `cuGetErrorString`.
///
/// # Safety
/// `p` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, p: *mut *const c_char) -> CUresult {
    entry_pre("cuGetErrorString", || match cuda_error(code.0) {
        Some((_, text)) => {
            out!(p, text.as_ptr().cast());
            Ok(())
        }
        None => {
            out!(p, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// The simulated driver's `cuGetProcAddress` (CUDA 11.3 form).
///
/// # Safety
/// `symbol` must be a C string and `pfn` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    entry_pre("cuGetProcAddress", || {
        let name = cstr!(symbol);
        let (p, _) = crate::procaddr::lookup(name, cuda_version, flags);
        out!(pfn, p as *mut c_void);
        if p == 0 {
            Err(CUDA_ERROR_NOT_FOUND)
        } else {
            Ok(())
        }
    })
}

/// The simulated driver's `cuGetProcAddress_v2` (CUDA 12 form, with the symbol status).
///
/// # Safety
/// `symbol` must be a C string, `pfn` valid for a write, `status` null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    entry_pre("cuGetProcAddress_v2", || {
        let name = cstr!(symbol);
        let (p, st) = crate::procaddr::lookup(name, cuda_version, flags);
        out!(pfn, p as *mut c_void);
        if !status.is_null() {
            out!(status, CUdriverProcAddressQueryResult(st));
        }
        if p == 0 {
            Err(CUDA_ERROR_NOT_FOUND)
        } else {
            Ok(())
        }
    })
}

/// The simulated driver's `cuGetExportTable`: the simulator has no private tables.
///
/// # Safety
/// None beyond the C ABI.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetExportTable(
    _table: *mut *const c_void,
    _id: *const CUuuid,
) -> CUresult {
    CUresult(CUDA_ERROR_NOT_SUPPORTED)
}

// ----- devices -----

fn name_into(buf: *mut c_char, len: c_int, text: &str) -> CuResult<()> {
    if buf.is_null() || len <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: the caller gave a buffer of `len` bytes; we write at most `len` (text + NUL).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    Ok(())
}

fn uuid_of(s: &Sim, dev: CUdevice) -> CuResult<CUuuid> {
    let p = s.phys(dev.0)?;
    Ok(CUuuid {
        bytes: s.devices[p].uuid.map(|b| b as c_char),
    })
}

exports! {
    cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) false |s| {
        s.phys(ordinal)?;
        out!(dev, CUdevice(ordinal));
        Ok(())
    }
    cuDeviceGetCount(count: *mut c_int) false |s| {
        out!(count, s.device_count() as c_int);
        Ok(())
    }
    cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) false |s| {
        s.phys(dev.0)?;
        name_into(name, len, &s.cfg.name)
    }
    cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) false |s| {
        out!(uuid, uuid_of(s, dev)?);
        Ok(())
    }
    cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) false |s| {
        out!(uuid, uuid_of(s, dev)?);
        Ok(())
    }
    cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) false |s| {
        let p = s.phys(dev.0)?;
        out!(bytes, s.devices[p].total as usize);
        Ok(())
    }
    cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) false |s| {
        let p = s.phys(dev.0)?;
        out!(bytes, s.devices[p].total.min(u32::MAX as u64) as c_uint);
        Ok(())
    }
    cuDeviceGetAttribute(value: *mut c_int, attr: c_int, dev: CUdevice) false |s| {
        out!(value, s.attribute(attr, dev.0)?);
        Ok(())
    }
    cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) false |s| {
        s.phys(dev.0)?;
        out!(major, s.cfg.compute_capability.0);
        out!(minor, s.cfg.compute_capability.1);
        Ok(())
    }
    cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: CUdevice) false |s| {
        let p = s.phys(dev.0)?;
        name_into(bus, len, &format!("00000000:{:02X}:00.0", p + 1))
    }
    cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus: *const c_char) false |s| {
        let text = cstr!(bus).to_ascii_uppercase();
        let p = (0..s.devices.len())
            .find(|p| text.ends_with(&format!("{:02X}:00.0", p + 1)))
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        out!(dev, CUdevice(s.ordinal_of(p).ok_or(CUDA_ERROR_INVALID_DEVICE)?));
        Ok(())
    }
    cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) false |s| {
        out!(pool, hp(s.default_pool(dev.0)?));
        Ok(())
    }
    cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) false |s| {
        out!(pool, hp(s.current_pool(dev.0)?));
        Ok(())
    }
    cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) false |s| {
        s.set_current_pool(dev.0, hv(pool))
    }
    cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: CUgraphMem_attribute, value: *mut c_void) false |s| {
        out!(value.cast::<u64>(), s.graph_mem_attr(dev.0, attr.0)?);
        Ok(())
    }
    cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: CUgraphMem_attribute, _value: *mut c_void) false |s| {
        s.graph_mem_attr(dev.0, attr.0)?;
        Ok(())
    }
    cuDeviceGraphMemTrim(dev: CUdevice) false |s| {
        s.graph_mem_trim(dev.0)
    }
}

// ----- contexts -----

exports! {
    cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) true |s| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pctx, hp(handle(tag::CTX, s.primary_retain(dev.0)?)));
        Ok(())
    }
    cuDevicePrimaryCtxRelease(dev: CUdevice) false |s| { s.primary_release(dev.0) }
    cuDevicePrimaryCtxRelease_v2(dev: CUdevice) false |s| { s.primary_release(dev.0) }
    cuDevicePrimaryCtxReset(dev: CUdevice) false |s| { s.primary_reset(dev.0) }
    cuDevicePrimaryCtxReset_v2(dev: CUdevice) false |s| { s.primary_reset(dev.0) }
    cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) false |s| {
        let (f, a) = s.primary_state(dev.0)?;
        out!(flags, f);
        out!(active, a as c_int);
        Ok(())
    }
    cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) false |s| { s.primary_set_flags(dev.0, flags) }
    cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) false |s| { s.primary_set_flags(dev.0, flags) }
    cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) true |s| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pctx, hp(handle(tag::CTX, s.ctx_create(flags, dev.0)?)));
        Ok(())
    }
    cuCtxCreate_v3(pctx: *mut CUcontext, _params: *mut c_void, _n: c_int, flags: c_uint, dev: CUdevice) true |s| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pctx, hp(handle(tag::CTX, s.ctx_create(flags, dev.0)?)));
        Ok(())
    }
    cuCtxCreate_v4(pctx: *mut CUcontext, _params: *mut c_void, flags: c_uint, dev: CUdevice) true |s| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pctx, hp(handle(tag::CTX, s.ctx_create(flags, dev.0)?)));
        Ok(())
    }
    cuCtxDestroy(ctx: CUcontext) false |s| { ctx_destroy(s, ctx) }
    cuCtxDestroy_v2(ctx: CUcontext) false |s| { ctx_destroy(s, ctx) }
    cuCtxGetCurrent(pctx: *mut CUcontext) false |s| {
        out!(pctx, hp(match s.current_or_null() { 0 => 0, id => handle(tag::CTX, id) }));
        Ok(())
    }
    cuCtxSetCurrent(ctx: CUcontext) false |s| {
        let id = if ctx.is_null() { 0 } else { ctx_id(ctx)? };
        s.set_current(id)
    }
    cuCtxPushCurrent_v2(ctx: CUcontext) false |s| { s.push(ctx_id(ctx)?) }
    cuCtxPopCurrent_v2(pctx: *mut CUcontext) false |s| {
        let id = s.pop()?;
        if !pctx.is_null() {
            out!(pctx, hp(handle(tag::CTX, id)));
        }
        Ok(())
    }
    cuCtxGetDevice(dev: *mut CUdevice) false |s| {
        out!(dev, CUdevice(s.ctx_info(0)?.0));
        Ok(())
    }
    cuCtxGetDevice_v2(dev: *mut CUdevice, ctx: CUcontext) false |s| {
        let id = if ctx.is_null() { 0 } else { ctx_id(ctx)? };
        out!(dev, CUdevice(s.ctx_info(id)?.0));
        Ok(())
    }
    cuCtxGetFlags(flags: *mut c_uint) false |s| {
        out!(flags, s.ctx_info(0)?.1);
        Ok(())
    }
    cuCtxGetId(ctx: CUcontext, id: *mut u64) false |s| {
        let c = if ctx.is_null() { s.current()? } else { ctx_id(ctx)? };
        out!(id, c);
        Ok(())
    }
    cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) false |s| {
        if !ctx.is_null() {
            s.ctx_info(ctx_id(ctx)?)?;
        }
        out!(version, 12000);
        Ok(())
    }
    cuCtxSynchronize() false |s| { s.ctx_sync(0) }
    cuCtxSynchronize_v2(ctx: CUcontext) false |s| {
        s.ctx_sync(if ctx.is_null() { 0 } else { ctx_id(ctx)? })
    }
    cuCtxSetLimit(limit: c_uint, value: usize) false |s| {
        s.ctx_limit(limit, Some(value as u64)).map(|_| ())
    }
    cuCtxGetLimit(value: *mut usize, limit: c_uint) false |s| {
        out!(value, s.ctx_limit(limit, None)? as usize);
        Ok(())
    }
    cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) false |s| {
        s.current()?;
        if !least.is_null() {
            out!(least, 0);
        }
        if !greatest.is_null() {
            out!(greatest, -5);
        }
        Ok(())
    }
    cuCtxGetCacheConfig(config: *mut c_uint) false |s| {
        s.current()?;
        out!(config, 0);
        Ok(())
    }
    cuCtxSetCacheConfig(_config: c_uint) false |s| { s.current().map(|_| ()) }
}

fn ctx_id(ctx: CUcontext) -> CuResult<u64> {
    crate::state::unhandle(tag::CTX, hv(ctx)).ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

fn ctx_destroy(s: &Sim, ctx: CUcontext) -> CuResult<()> {
    s.ctx_destroy(ctx_id(ctx)?)
}

// ----- memory -----

fn write_attr(data: *mut c_void, v: PtrAttr) -> CuResult<()> {
    match v {
        PtrAttr::U32(x) => out!(data.cast::<u32>(), x),
        PtrAttr::U64(x) => out!(data.cast::<u64>(), x),
    }
    Ok(())
}

exports! {
    cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) true |s| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.mem_alloc(size as u64)?));
        Ok(())
    }
    cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) true |s| {
        if dptr.is_null() || pitch.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (p, pt) = s.mem_alloc_pitch(width as u64, height as u64, elem)?;
        out!(dptr, CUdeviceptr(p));
        out!(pitch, pt as usize);
        Ok(())
    }
    cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) true |s| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.mem_alloc_managed(size as u64, flags)?));
        Ok(())
    }
    cuMemFree_v2(dptr: CUdeviceptr) false |s| { s.mem_free(dptr.0) }
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize) false |s| {
        let (f, t) = s.mem_info()?;
        out!(free, f as usize);
        out!(total, t as usize);
        Ok(())
    }
    cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) false |s| {
        let (b, n) = s.address_range(dptr.0)?;
        if !base.is_null() {
            out!(base, CUdeviceptr(b));
        }
        if !size.is_null() {
            out!(size, n as usize);
        }
        Ok(())
    }
    cuPointerGetAttribute(data: *mut c_void, attr: CUpointer_attribute, ptr: CUdeviceptr) false |s| {
        write_attr(data, s.pointer_attr(attr.0, ptr.0)?)
    }
    cuPointerGetAttributes(n: c_uint, attrs: *mut CUpointer_attribute, data: *mut *mut c_void, ptr: CUdeviceptr) false |s| {
        if attrs.is_null() || data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for i in 0..n as usize {
            // SAFETY: the caller passes arrays of `n` attributes and `n` data pointers.
            let (a, d) = unsafe { (*attrs.add(i), *data.add(i)) };
            match s.pointer_attr(a.0, ptr.0) {
                Ok(v) => write_attr(d, v)?,
                // Unknown pointers read as zeroes here, as with the real driver.
                Err(_) => match a.0 {
                    2 | 9 | 6 | 8 | 10 | 13 | 15 | 16 => out!(d.cast::<u32>(), 0),
                    _ => out!(d.cast::<u64>(), 0),
                },
            }
        }
        Ok(())
    }
    cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) false |s| {
        out!(pp, hp(s.host_alloc(size as u64)?));
        Ok(())
    }
    cuMemHostAlloc(pp: *mut *mut c_void, size: usize, _flags: c_uint) false |s| {
        out!(pp, hp(s.host_alloc(size as u64)?));
        Ok(())
    }
    cuMemFreeHost(p: *mut c_void) false |s| { s.host_free(hv(p)) }
    cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, p: *mut c_void, _flags: c_uint) false |s| {
        s.current()?;
        out!(dptr, CUdeviceptr(hv(p)));
        Ok(())
    }
    cuMemHostRegister_v2(_p: *mut c_void, _size: usize, _flags: c_uint) false |s| { s.current().map(|_| ()) }
    cuMemHostUnregister(_p: *mut c_void) false |s| { s.current().map(|_| ()) }
    cuIpcGetMemHandle(h: *mut CUipcMemHandle, dptr: CUdeviceptr) false |s| {
        let bytes = s.ipc_handle(dptr.0)?;
        out!(h, CUipcMemHandle { reserved: bytes.map(|b| b as c_char) });
        Ok(())
    }
    cuIpcCloseMemHandle(_dptr: CUdeviceptr) false |_s| { Err(CUDA_ERROR_INVALID_VALUE) }
}

/// The simulated driver's `cuIpcOpenMemHandle_v2`: mapping another process's memory is not
/// simulated.
///
/// # Safety
/// None beyond the C ABI.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    _dptr: *mut CUdeviceptr,
    _h: CUipcMemHandle,
    _flags: c_uint,
) -> CUresult {
    entry("cuIpcOpenMemHandle_v2", false, |_| {
        Err(CUDA_ERROR_NOT_SUPPORTED)
    })
}

// ----- copies and memsets -----

exports_pt! {
    cuMemcpyHtoD_v2 / cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) false |s, _pt| {
        s.memcpy(dst.0, src as u64, n as u64, true, false)
    }
    cuMemcpyDtoH_v2 / cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) false |s, _pt| {
        s.memcpy(hv(dst), src.0, n as u64, false, true)
    }
    cuMemcpyDtoD_v2 / cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) false |s, _pt| {
        s.memcpy(dst.0, src.0, n as u64, true, true)
    }
    cuMemcpy / cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) false |s, _pt| {
        let (dd, sd) = (s.is_device_ptr(dst.0), s.is_device_ptr(src.0));
        s.memcpy(dst.0, src.0, n as u64, dd, sd)
    }
    cuMemsetD8_v2 / cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) false |s, _pt| {
        s.memset(dst.0, v as u32, 1, n as u64)
    }
    cuMemsetD16_v2 / cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) false |s, _pt| {
        s.memset(dst.0, v as u32, 2, n as u64)
    }
    cuMemsetD32_v2 / cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: c_uint, n: usize) false |s, _pt| {
        s.memset(dst.0, v, 4, n as u64)
    }
    cuMemcpyHtoDAsync_v2 / cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(dst.0, src as u64, n as u64, (true, false), hv(st), pt)
    }
    cuMemcpyDtoHAsync_v2 / cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(hv(dst), src.0, n as u64, (false, true), hv(st), pt)
    }
    cuMemcpyDtoDAsync_v2 / cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(dst.0, src.0, n as u64, (true, true), hv(st), pt)
    }
    cuMemcpyAsync / cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, st: CUstream) false |s, pt| {
        let (dd, sd) = (s.is_device_ptr(dst.0), s.is_device_ptr(src.0));
        s.memcpy_async(dst.0, src.0, n as u64, (dd, sd), hv(st), pt)
    }
    cuMemsetD8Async / cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, st: CUstream) false |s, pt| {
        s.memset_async(dst.0, v as u32, 1, n as u64, hv(st), pt)
    }
    cuMemsetD32Async / cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: c_uint, n: usize, st: CUstream) false |s, pt| {
        s.memset_async(dst.0, v, 4, n as u64, hv(st), pt)
    }
}

// ----- virtual memory management -----

fn prop_bytes(p: &CUmemAllocationProp) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0..4].copy_from_slice(&p.type_.0.to_le_bytes());
    b[4..8].copy_from_slice(&p.requestedHandleTypes.to_le_bytes());
    b[8..12].copy_from_slice(&p.location.type_.0.to_le_bytes());
    b[12..16].copy_from_slice(&p.location.id.to_le_bytes());
    b[24] = p.allocFlags.compressionType;
    b[25] = p.allocFlags.gpuDirectRDMACapable;
    b[26..28].copy_from_slice(&p.allocFlags.usage.to_le_bytes());
    b
}

fn prop_from_bytes(b: &[u8; 32]) -> CUmemAllocationProp {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    CUmemAllocationProp {
        type_: vgpu_cuda_abi::CUmemAllocationType(u32_at(0)),
        requestedHandleTypes: u32_at(4),
        location: CUmemLocation {
            type_: vgpu_cuda_abi::CUmemLocationType(u32_at(8)),
            id: u32_at(12) as c_int,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: vgpu_cuda_abi::CUmemAllocationPropFlags {
            compressionType: b[24],
            gpuDirectRDMACapable: b[25],
            usage: u16::from_le_bytes([b[26], b[27]]),
            reserved: [0; 4],
        },
    }
}

/// Device ordinal of a device location, `None` for host locations.
fn location(loc: &CUmemLocation) -> CuResult<Option<i32>> {
    match loc.type_.0 {
        1 => Ok(Some(loc.id)),
        2..=4 => Ok(None),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

exports! {
    cuMemCreate(h: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) true |s| {
        if h.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p: CUmemAllocationProp = inp!(prop);
        if p.type_.0 != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = s.mem_create(size as u64, location(&p.location)?, prop_bytes(&p))?;
        out!(h, CUmemGenericAllocationHandle(id));
        Ok(())
    }
    cuMemRelease(h: CUmemGenericAllocationHandle) false |s| { s.mem_release(h.0) }
    cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, _addr: CUdeviceptr, _flags: u64) false |s| {
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(ptr, CUdeviceptr(s.address_reserve(size as u64, align as u64)?));
        Ok(())
    }
    cuMemAddressFree(ptr: CUdeviceptr, size: usize) false |s| { s.address_free(ptr.0, size as u64) }
    cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, h: CUmemGenericAllocationHandle, flags: u64) false |s| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.mem_map(ptr.0, size as u64, offset as u64, h.0)
    }
    cuMemUnmap(ptr: CUdeviceptr, size: usize) false |s| { s.mem_unmap(ptr.0, size as u64) }
    cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) false |s| {
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.set_access(ptr.0, size as u64)
    }
    cuMemGetAccess(flags: *mut u64, _loc: *const CUmemLocation, ptr: CUdeviceptr) false |s| {
        s.set_access(ptr.0, 1)?;
        out!(flags, 3);
        Ok(())
    }
    cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, _option: CUmemAllocationGranularity_flags) false |s| {
        let p: CUmemAllocationProp = inp!(prop);
        if let Some(ord) = location(&p.location)? {
            s.phys(ord)?;
        }
        out!(g, crate::state::GRANULARITY as usize);
        Ok(())
    }
    cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, h: CUmemGenericAllocationHandle) false |s| {
        out!(prop, prop_from_bytes(&s.handle_props(h.0)?));
        Ok(())
    }
    cuMemRetainAllocationHandle(h: *mut CUmemGenericAllocationHandle, addr: *mut c_void) false |s| {
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(h, CUmemGenericAllocationHandle(s.retain_handle(hv(addr))?));
        Ok(())
    }
    cuMemExportToShareableHandle(_sh: *mut c_void, _h: CUmemGenericAllocationHandle, _t: c_uint, _f: u64) false |_s| {
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
}

// ----- stream-ordered allocation -----

exports_pt! {
    cuMemAllocAsync / cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, st: CUstream) true |s, pt| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.alloc_async(size as u64, 0, hv(st), pt)?));
        Ok(())
    }
    cuMemAllocFromPoolAsync / cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, st: CUstream) true |s, pt| {
        if dptr.is_null() || pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.alloc_async(size as u64, hv(pool), hv(st), pt)?));
        Ok(())
    }
    cuMemFreeAsync / cuMemFreeAsync_ptsz(dptr: CUdeviceptr, st: CUstream) false |s, pt| {
        s.free_async(dptr.0, hv(st), pt)
    }
}

exports! {
    cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) false |s| {
        let p: CUmemPoolProps = inp!(props);
        if p.allocType.0 != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ord = location(&p.location)?.ok_or(CUDA_ERROR_NOT_SUPPORTED)?;
        out!(pool, hp(s.pool_create(ord)?));
        Ok(())
    }
    cuMemPoolDestroy(pool: CUmemoryPool) false |s| { s.pool_destroy(hv(pool)) }
    cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) false |s| { s.pool_trim(hv(pool), keep as u64) }
    cuMemPoolGetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) false |s| {
        let v = s.pool_get_attr(hv(pool), attr.0)?;
        if attr.0 <= 3 {
            out!(value.cast::<c_int>(), v as c_int);
        } else {
            out!(value.cast::<u64>(), v);
        }
        Ok(())
    }
    cuMemPoolSetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) false |s| {
        let v = if attr.0 <= 3 { inp!(value.cast::<c_int>()) as u64 } else { inp!(value.cast::<u64>()) };
        s.pool_set_attr(hv(pool), attr.0, v)
    }
    cuMemPoolSetAccess(pool: CUmemoryPool, _desc: *const CUmemAccessDesc, _count: usize) false |s| {
        s.pool_get_attr(hv(pool), 4).map(|_| ())
    }
}

// ----- arrays -----

fn desc2(d: &CUDA_ARRAY_DESCRIPTOR) -> ArrayDesc {
    ArrayDesc {
        width: d.Width as u64,
        height: d.Height as u64,
        depth: 0,
        format: d.Format.0,
        channels: d.NumChannels,
        flags: 0,
    }
}

fn desc3(d: &CUDA_ARRAY3D_DESCRIPTOR) -> ArrayDesc {
    ArrayDesc {
        width: d.Width as u64,
        height: d.Height as u64,
        depth: d.Depth as u64,
        format: d.Format.0,
        channels: d.NumChannels,
        flags: d.Flags,
    }
}

exports! {
    cuArrayCreate_v2(h: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) true |s| {
        let d: CUDA_ARRAY_DESCRIPTOR = inp!(desc);
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(h, hp(s.array_create(desc2(&d))?));
        Ok(())
    }
    cuArray3DCreate_v2(h: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) true |s| {
        let d: CUDA_ARRAY3D_DESCRIPTOR = inp!(desc);
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(h, hp(s.array_create(desc3(&d))?));
        Ok(())
    }
    cuArrayDestroy(h: CUarray) false |s| { s.array_destroy(hv(h)) }
    cuArrayGetDescriptor_v2(desc: *mut CUDA_ARRAY_DESCRIPTOR, h: CUarray) false |s| {
        let d = s.array_desc(hv(h))?;
        out!(desc, CUDA_ARRAY_DESCRIPTOR {
            Width: d.width as usize,
            Height: d.height as usize,
            Format: vgpu_cuda_abi::CUarray_format(d.format),
            NumChannels: d.channels,
        });
        Ok(())
    }
    cuArray3DGetDescriptor_v2(desc: *mut CUDA_ARRAY3D_DESCRIPTOR, h: CUarray) false |s| {
        let d = s.array_desc(hv(h))?;
        out!(desc, CUDA_ARRAY3D_DESCRIPTOR {
            Width: d.width as usize,
            Height: d.height as usize,
            Depth: d.depth as usize,
            Format: vgpu_cuda_abi::CUarray_format(d.format),
            NumChannels: d.channels,
            Flags: d.flags,
        });
        Ok(())
    }
    cuMipmappedArrayCreate(h: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) true |s| {
        let d: CUDA_ARRAY3D_DESCRIPTOR = inp!(desc);
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(h, hp(s.mipmap_create(desc3(&d), levels)?));
        Ok(())
    }
    cuMipmappedArrayGetLevel(level_array: *mut CUarray, h: CUmipmappedArray, level: c_uint) false |s| {
        out!(level_array, hp(s.mipmap_level(hv(h), level)?));
        Ok(())
    }
    cuMipmappedArrayDestroy(h: CUmipmappedArray) false |s| { s.mipmap_destroy(hv(h)) }
}

// ----- streams and events -----

exports! {
    cuStreamCreate(st: *mut CUstream, flags: c_uint) false |s| {
        out!(st, hp(s.stream_create(flags)?));
        Ok(())
    }
    cuStreamCreateWithPriority(st: *mut CUstream, flags: c_uint, _prio: c_int) false |s| {
        out!(st, hp(s.stream_create(flags)?));
        Ok(())
    }
    cuStreamDestroy_v2(st: CUstream) false |s| { s.stream_destroy(hv(st)) }
    cuStreamDestroy(st: CUstream) false |s| { s.stream_destroy(hv(st)) }
    cuEventCreate(ev: *mut CUevent, flags: c_uint) false |s| {
        out!(ev, hp(s.event_create(flags)?));
        Ok(())
    }
    cuEventDestroy_v2(ev: CUevent) false |s| { s.event_destroy(hv(ev)) }
    cuEventDestroy(ev: CUevent) false |s| { s.event_destroy(hv(ev)) }
    cuEventSynchronize(ev: CUevent) false |s| { s.event_sync(hv(ev)) }
    cuEventQuery(ev: CUevent) false |s| { s.event_query(hv(ev)) }
    cuEventElapsedTime(ms: *mut f32, a: CUevent, b: CUevent) false |s| {
        out!(ms, s.event_elapsed(hv(a), hv(b))?);
        Ok(())
    }
    cuEventElapsedTime_v2(ms: *mut f32, a: CUevent, b: CUevent) false |s| {
        out!(ms, s.event_elapsed(hv(a), hv(b))?);
        Ok(())
    }
}

exports_pt! {
    cuStreamSynchronize / cuStreamSynchronize_ptsz(st: CUstream) false |s, pt| { s.stream_sync(hv(st), pt) }
    cuStreamQuery / cuStreamQuery_ptsz(st: CUstream) false |s, pt| { s.stream_query(hv(st), pt) }
    cuStreamWaitEvent / cuStreamWaitEvent_ptsz(st: CUstream, ev: CUevent, _flags: c_uint) false |s, pt| {
        s.stream_wait_event(hv(st), hv(ev), pt)
    }
    cuStreamGetFlags / cuStreamGetFlags_ptsz(st: CUstream, flags: *mut c_uint) false |s, _pt| {
        out!(flags, s.stream_flags(hv(st))?);
        Ok(())
    }
    cuStreamGetPriority / cuStreamGetPriority_ptsz(st: CUstream, prio: *mut c_int) false |s, _pt| {
        s.stream_flags(hv(st))?;
        out!(prio, 0);
        Ok(())
    }
    cuStreamGetCtx / cuStreamGetCtx_ptsz(st: CUstream, pctx: *mut CUcontext) false |s, _pt| {
        let ctx = match crate::state::unhandle(tag::STREAM, hv(st)) {
            None => s.current()?,
            Some(_) => {
                s.stream_flags(hv(st))?;
                s.current()?
            }
        };
        out!(pctx, hp(handle(tag::CTX, ctx)));
        Ok(())
    }
    cuEventRecord / cuEventRecord_ptsz(ev: CUevent, st: CUstream) false |s, pt| { s.event_record(hv(ev), hv(st), pt) }
    cuEventRecordWithFlags / cuEventRecordWithFlags_ptsz(ev: CUevent, st: CUstream, _flags: c_uint) false |s, pt| {
        s.event_record(hv(ev), hv(st), pt)
    }
    cuStreamBeginCapture_v2 / cuStreamBeginCapture_v2_ptsz(st: CUstream, mode: c_uint) false |s, _pt| {
        s.begin_capture(hv(st), mode)
    }
    cuStreamBeginCapture / cuStreamBeginCapture_ptsz(st: CUstream) false |s, _pt| { s.begin_capture(hv(st), 0) }
    cuStreamEndCapture / cuStreamEndCapture_ptsz(st: CUstream, graph: *mut CUgraph) false |s, _pt| {
        if graph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(graph, hp(s.end_capture(hv(st))?));
        Ok(())
    }
    cuStreamIsCapturing / cuStreamIsCapturing_ptsz(st: CUstream, status: *mut c_uint) false |s, _pt| {
        out!(status, s.is_capturing(hv(st))?);
        Ok(())
    }
    cuStreamGetCaptureInfo_v2 / cuStreamGetCaptureInfo_v2_ptsz(st: CUstream, status: *mut c_uint, id: *mut u64, graph: *mut CUgraph, deps: *mut *const CUgraphNode, ndeps: *mut usize) false |s, _pt| {
        out!(status, s.is_capturing(hv(st))?);
        if !id.is_null() {
            out!(id, hv(st));
        }
        if !graph.is_null() {
            out!(graph, std::ptr::null_mut());
        }
        if !deps.is_null() {
            out!(deps, std::ptr::null());
        }
        if !ndeps.is_null() {
            out!(ndeps, 0);
        }
        Ok(())
    }
}

// ----- modules and launches -----

/// A library handle is its module's handle with the top bit set, so that the two kinds are
/// told apart (a module handle passed as a library is `CUDA_ERROR_INVALID_HANDLE`).
const LIBRARY_BIT: u64 = 1 << 63;

fn library_of(module: u64) -> u64 {
    module | LIBRARY_BIT
}

fn module_of(library: u64) -> CuResult<u64> {
    if library & LIBRARY_BIT == 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(library & !LIBRARY_BIT)
}

fn load_image(s: &Sim, image: *const c_void) -> CuResult<u64> {
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: module images are NUL-terminated text for the simulator (the real driver also
    // takes PTX as a C string); a non-text image is rejected after reading its first bytes.
    let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) };
    s.module_load(text.to_bytes())
}

/// Packs kernel arguments from `kernelParams` (one pointer per parameter) or from `extra`
/// (`CU_LAUNCH_PARAM_BUFFER_POINTER`/`_SIZE`).
fn pack_args(k: Kernel, params: *mut *mut c_void, extra: *mut *mut c_void) -> CuResult<Vec<u8>> {
    let sizes = k.param_sizes();
    let mut out = Vec::with_capacity(20);
    if !params.is_null() {
        for (i, &n) in sizes.iter().enumerate() {
            // SAFETY: the driver API requires `kernelParams` to hold one valid pointer per
            // kernel parameter, each pointing at a value of that parameter's size.
            let arg = unsafe { *params.add(i) };
            if arg.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: as above.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(arg.cast::<u8>(), n) });
        }
        return Ok(out);
    }
    if !extra.is_null() {
        let (mut buf, mut size) = (std::ptr::null::<u8>(), 0usize);
        let mut i = 0;
        loop {
            // SAFETY: `extra` is a key/value list ending in CU_LAUNCH_PARAM_END (0).
            let key = unsafe { *extra.add(i) } as usize;
            match key {
                0 => break,
                // SAFETY: BUFFER_POINTER and BUFFER_SIZE are followed by their value.
                1 => buf = unsafe { *extra.add(i + 1) }.cast::<u8>(),
                // SAFETY: BUFFER_SIZE's value points at a size_t.
                2 => size = unsafe { *(*extra.add(i + 1)).cast::<usize>() },
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
            i += 2;
        }
        let mut off = 0usize;
        for &n in sizes {
            off = off.div_ceil(n) * n;
            if buf.is_null() || off + n > size {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: `buf` holds `size` bytes of packed arguments; checked above.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(buf.add(off), n) });
            off += n;
        }
        return Ok(out);
    }
    if sizes.is_empty() {
        Ok(out)
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

fn launch(
    s: &'static Sim,
    f: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
    pt: bool,
) -> CuResult<()> {
    let (kernel, dev) = s.function_to_launch(hv(f))?;
    s.check_dims(grid, block, cooperative)?;
    let args = pack_args(kernel, params, extra)?;
    s.launch(
        Launch {
            kernel,
            dev,
            grid,
            block,
            args,
        },
        hv(stream),
        pt,
    )
}

exports! {
    cuModuleLoadData(m: *mut CUmodule, image: *const c_void) false |s| {
        if m.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(m, hp(load_image(s, image)?));
        Ok(())
    }
    cuModuleLoadDataEx(m: *mut CUmodule, image: *const c_void, _n: c_uint, _opts: *mut c_uint, _vals: *mut *mut c_void) false |s| {
        if m.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(m, hp(load_image(s, image)?));
        Ok(())
    }
    cuModuleLoadFatBinary(m: *mut CUmodule, image: *const c_void) false |s| {
        if m.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(m, hp(load_image(s, image)?));
        Ok(())
    }
    cuModuleLoad(m: *mut CUmodule, path: *const c_char) false |s| {
        let path = cstr!(path);
        let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        out!(m, hp(s.module_load(&bytes[..end])?));
        Ok(())
    }
    cuModuleUnload(m: CUmodule) false |s| { s.module_unload(hv(m)) }
    // Libraries are modules of the current context here (the real driver loads them into
    // every context, context-independently).
    cuLibraryLoadData(l: *mut CUmodule, code: *const c_void, _jo: *mut c_uint, _jv: *mut *mut c_void, _njo: c_uint, _lo: *mut c_uint, _lv: *mut *mut c_void, _nlo: c_uint) false |s| {
        if l.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(l, hp(library_of(load_image(s, code)?)));
        Ok(())
    }
    cuLibraryLoadFromFile(l: *mut CUmodule, path: *const c_char, _jo: *mut c_uint, _jv: *mut *mut c_void, _njo: c_uint, _lo: *mut c_uint, _lv: *mut *mut c_void, _nlo: c_uint) false |s| {
        if l.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let path = cstr!(path);
        let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        out!(l, hp(library_of(s.module_load(&bytes[..end])?)));
        Ok(())
    }
    cuLibraryUnload(l: CUmodule) false |s| { s.module_unload(module_of(hv(l))?) }
    cuLibraryGetModule(m: *mut CUmodule, l: CUmodule) false |s| {
        let module = module_of(hv(l))?;
        s.module_check(module)?;
        out!(m, hp(module));
        Ok(())
    }
    cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) false |s| {
        let name = cstr!(name);
        out!(f, hp(s.get_function(hv(m), name)?));
        Ok(())
    }
    cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: CUfunction) false |s| {
        s.function(hv(f))?;
        out!(v, match attr { 0 => 1024, 4 => 32, _ => 0 });
        Ok(())
    }
    cuFuncSetAttribute(f: CUfunction, _attr: c_int, _v: c_int) false |s| { s.function(hv(f)).map(|_| ()) }
    cuFuncSetCacheConfig(f: CUfunction, _c: c_uint) false |s| { s.function(hv(f)).map(|_| ()) }
    cuOccupancyMaxActiveBlocksPerMultiprocessor(n: *mut c_int, f: CUfunction, block: c_int, _smem: usize) false |s| {
        s.function(hv(f))?;
        out!(n, (2048 / block.max(1)).clamp(1, 32));
        Ok(())
    }
}

exports_pt! {
    cuLaunchKernel / cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, st: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) false |s, pt| {
        launch(s, f, [gx, gy, gz], [bx, by, bz], st, params, extra, false, pt)
    }
    cuLaunchCooperativeKernel / cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, st: CUstream, params: *mut *mut c_void) false |s, pt| {
        launch(s, f, [gx, gy, gz], [bx, by, bz], st, params, std::ptr::null_mut(), true, pt)
    }
    cuLaunchKernelEx / cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) false |s, pt| {
        let c: CUlaunchConfig = inp!(config);
        launch(
            s,
            f,
            [c.gridDimX, c.gridDimY, c.gridDimZ],
            [c.blockDimX, c.blockDimY, c.blockDimZ],
            c.hStream,
            params,
            extra,
            false,
            pt,
        )
    }
    cuGraphLaunch / cuGraphLaunch_ptsz(exec: CUgraphExec, st: CUstream) false |s, pt| {
        s.graph_launch(hv(exec), hv(st), pt)
    }
    cuGraphUpload / cuGraphUpload_ptsz(exec: CUgraphExec, st: CUstream) true |s, pt| {
        s.graph_upload(hv(exec), hv(st), pt)
    }
}

// ----- graphs -----

/// `CUDA_KERNEL_NODE_PARAMS` (v1 and the shared prefix of v2).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KernelNodeParams {
    /// `func`
    pub func: CUfunction,
    /// `gridDimX`, `gridDimY`, `gridDimZ`
    pub grid: [c_uint; 3],
    /// `blockDimX`, `blockDimY`, `blockDimZ`
    pub block: [c_uint; 3],
    /// `sharedMemBytes`
    pub shared_mem_bytes: c_uint,
    /// `kernelParams`
    pub kernel_params: *mut *mut c_void,
    /// `extra`
    pub extra: *mut *mut c_void,
}

const _: () = assert!(std::mem::size_of::<KernelNodeParams>() == 56);

fn add_kernel_node(
    s: &Sim,
    node: *mut CUgraphNode,
    g: CUgraph,
    p: *const KernelNodeParams,
) -> CuResult<()> {
    let p: KernelNodeParams = inp!(p);
    let (kernel, dev) = s.function_to_launch(hv(p.func))?;
    s.check_dims(p.grid, p.block, false)?;
    let args = pack_args(kernel, p.kernel_params, p.extra)?;
    out!(
        node,
        hp(s.graph_add_kernel(
            hv(g),
            Launch {
                kernel,
                dev,
                grid: p.grid,
                block: p.block,
                args
            }
        )?)
    );
    Ok(())
}

exports! {
    cuGraphCreate(g: *mut CUgraph, _flags: c_uint) false |s| {
        out!(g, hp(s.graph_create()?));
        Ok(())
    }
    cuGraphDestroy(g: CUgraph) false |s| { s.graph_destroy(hv(g)) }
    cuGraphAddKernelNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, p: *const KernelNodeParams) false |s| {
        add_kernel_node(s, node, g, p)
    }
    cuGraphAddKernelNode_v2(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, p: *const KernelNodeParams) false |s| {
        add_kernel_node(s, node, g, p)
    }
    cuGraphAddEmptyNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize) false |s| {
        out!(node, hp(s.graph_add_empty(hv(g))?));
        Ok(())
    }
    cuGraphAddMemAllocNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS) true |s| {
        let mut p: CUDA_MEM_ALLOC_NODE_PARAMS = inp!(params);
        let ord = location(&p.poolProps.location)?.ok_or(CUDA_ERROR_NOT_SUPPORTED)?;
        let (n, dptr) = s.graph_add_mem_alloc(hv(g), ord, p.bytesize as u64)?;
        p.dptr = CUdeviceptr(dptr);
        out!(params, p);
        out!(node, hp(n));
        Ok(())
    }
    cuGraphAddMemFreeNode(node: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _n: usize, dptr: CUdeviceptr) false |s| {
        out!(node, hp(s.graph_add_mem_free(hv(g), dptr.0)?));
        Ok(())
    }
    cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) false |s| {
        let all = s.graph_nodes(hv(g))?;
        if nodes.is_null() {
            out!(count, all.len());
            return Ok(());
        }
        let cap: usize = inp!(count);
        for (i, n) in all.iter().take(cap).enumerate() {
            out!(nodes.wrapping_add(i), hp(*n));
        }
        out!(count, all.len().min(cap));
        Ok(())
    }
    cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, g: CUgraph, _flags: u64) false |s| {
        out!(exec, hp(s.graph_instantiate(hv(g))?));
        Ok(())
    }
    cuGraphInstantiate_v2(exec: *mut CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, _log: *mut c_char, _n: usize) false |s| {
        out!(exec, hp(s.graph_instantiate(hv(g))?));
        if !err_node.is_null() {
            out!(err_node, std::ptr::null_mut());
        }
        Ok(())
    }
    cuGraphExecDestroy(exec: CUgraphExec) false |s| { s.graph_exec_destroy(hv(exec)) }
}
