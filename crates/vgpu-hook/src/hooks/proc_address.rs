//! Initialization and symbol lookup: both hooks are list lines ("forward, then ..."); these
//! are the follow-ups.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// `cuInit` succeeded: refuse it when enforcement could not be set up (never run unlimited).
pub(crate) fn initialized(_cuda: &Cuda) -> Result<(), CUresult> {
    match state::get() {
        Enforcement::Ready(_) => Ok(()),
        Enforcement::Broken(why) => {
            vlog!(ERROR, "cuInit refused: {why}");
            Err(CUresult::NOT_INITIALIZED)
        }
    }
}

/// `cuGetProcAddress[_v2]` succeeded: replaces `*pfn` (what the real one returned) by our
/// wrapper where hooked.
///
/// # Safety
/// `symbol` and `pfn` are the pointers the driver just read and wrote (or null).
pub(crate) unsafe fn proc_address_found(
    cuda: &Cuda,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> Result<(), CUresult> {
    if symbol.is_null() || pfn.is_null() {
        return Ok(());
    }
    // SAFETY: the driver just read `symbol` as a C string and wrote `*pfn`.
    let (name, found) = unsafe { (CStr::from_ptr(symbol), *pfn) };
    let Ok(name) = name.to_str() else {
        return Ok(());
    };
    let ours = crate::interpose::substitute_proc_address(cuda, name, found, version, flags);
    if ours != found {
        vlog!(
            DEBUG,
            "cuGetProcAddress({name}, {version}, {flags}) -> hook"
        );
        // SAFETY: `pfn` is the caller's valid out-pointer.
        unsafe { *pfn = ours };
    }
    Ok(())
}
