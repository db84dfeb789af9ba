//! Initialization and symbol lookup.

use super::*;

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
pub(super) unsafe fn patch_proc_address(
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
