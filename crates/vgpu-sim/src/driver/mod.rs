//! The exported CUDA driver API: pointer translation around [`crate::state::Sim`].
//!
//! Every export runs inside `entry`: the driver must be initialized (except for the few
//! functions real drivers answer before `cuInit`), injected faults apply, and a panic becomes
//! `CUDA_ERROR_UNKNOWN` instead of unwinding into C.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};

use vgpu_cuda_abi::{
    CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUDA_KERNEL_NODE_PARAMS_v1,
    CUDA_MEM_ALLOC_NODE_PARAMS, CUarray, CUcontext, CUdevice, CUdeviceptr,
    CUdriverProcAddressQueryResult, CUevent, CUfunction, CUgraph, CUgraphExec,
    CUgraphMem_attribute, CUgraphNode, CUipcMemHandle, CUlaunchConfig, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUmemAllocationProp, CUmemGenericAllocationHandle,
    CUmemLocation, CUmemPool_attribute, CUmemPoolProps, CUmemoryPool, CUmipmappedArray, CUmodule,
    CUpointer_attribute, CUresult, CUstream, CUuuid, c_char, c_int, c_uint, c_void,
};

use crate::codes::*;
use crate::hostmem::HostPtr;
use crate::state::{
    Addr, ArrayDesc, CuResult, Kernel, Launch, PtrAttr, Sim, StreamArg, global, handle, inited, tag,
};

/// Writes an out-parameter, rejecting null with `CUDA_ERROR_INVALID_VALUE`.
macro_rules! out {
    ($p:expr, $v:expr) => {
        write_out!($p, $v, CUDA_ERROR_INVALID_VALUE)
    };
}

/// Writes what `$make` creates to the out-parameter `$p`, which is checked first: a null one
/// gets `CUDA_ERROR_INVALID_VALUE` before anything is created, so nothing is left behind.
macro_rules! out_created {
    ($p:expr, $make:expr) => {{
        let p = $p;
        if p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(p, $make);
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

/// The stream `st` as a call names it, from a `_ptsz` export when `per_thread`.
fn stream(st: CUstream, per_thread: bool) -> StreamArg {
    StreamArg {
        handle: hv(st),
        per_thread,
    }
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

/// `cuGetErrorName`/`cuGetErrorString`: writes the C string `pick` chooses from the code's
/// `(name, description)`, or null and `CUDA_ERROR_INVALID_VALUE` for an unknown code.
///
/// # Safety
/// `p` must be valid for a write.
unsafe fn describe_error(
    symbol: &'static str,
    code: CUresult,
    p: *mut *const c_char,
    pick: fn((&'static str, &'static str)) -> &'static str,
) -> CUresult {
    entry_pre(symbol, || match cuda_error(code.0) {
        Some(error) => {
            out!(p, pick(error).as_ptr().cast());
            Ok(())
        }
        None => {
            out!(p, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// The simulated driver's `cuGetErrorName`: unknown codes give `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `p` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, p: *mut *const c_char) -> CUresult {
    // SAFETY: forwarded from this function's own contract.
    unsafe { describe_error("cuGetErrorName", code, p, |(name, _)| name) }
}

/// The simulated driver's `cuGetErrorString`.
///
/// # Safety
/// `p` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, p: *mut *const c_char) -> CUresult {
    // SAFETY: forwarded from this function's own contract.
    unsafe { describe_error("cuGetErrorString", code, p, |(_, text)| text) }
}

/// Both forms of `cuGetProcAddress`: looks `symbol` up and writes its address (null when
/// there is none) to `pfn`. Returns the call's answer (`CUDA_ERROR_NOT_FOUND` without an
/// address) and the lookup's status for `_v2`.
fn proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CuResult<(CuResult<()>, u32)> {
    let name = cstr!(symbol);
    let (p, status) = procaddr::lookup(name, cuda_version, flags);
    out!(pfn, p as *mut c_void);
    let found = if p == 0 {
        Err(CUDA_ERROR_NOT_FOUND)
    } else {
        Ok(())
    };
    Ok((found, status))
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
        let (found, _) = proc_address(symbol, pfn, cuda_version, flags)?;
        found
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
        let (found, st) = proc_address(symbol, pfn, cuda_version, flags)?;
        if !status.is_null() {
            out!(status, CUdriverProcAddressQueryResult(st));
        }
        found
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

// One file per subsystem; the macros above are in scope in each.
mod arrays;
mod contexts;
mod devices;
mod graphs;
mod launches;
mod memory;
pub mod procaddr;
mod streams;
mod vmm;

pub use arrays::*;
pub use contexts::*;
pub use devices::*;
pub use graphs::*;
pub use launches::*;
pub use memory::*;
pub use streams::*;
pub use vmm::*;
