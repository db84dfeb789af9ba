//! Modules and libraries: their code takes device memory, charged as module memory by
//! reconciling with NVML's per-process used memory after each load and unload. Every hook
//! here is a list line ("forward, then ..."); these are the follow-ups.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// After a module or library load: charge what it put on the device; a load whose memory
/// the limit refuses (or any load while enforcement is off) is undone and fails with
/// `CUDA_ERROR_OUT_OF_MEMORY`.
fn code_loaded(cuda: &Cuda, unload: impl FnOnce() -> Result<(), CUresult>) -> Result<(), CUresult> {
    // Code takes device memory: while enforcement is off the load is undone and refused.
    let st = match ready() {
        Ok(st) => st,
        Err(refused) => {
            if let Err(undone) = unload() {
                vlog!(
                    ERROR,
                    "could not unload code refused with enforcement off ({undone:?})"
                );
            }
            return Err(refused);
        }
    };
    if let Err(oom) = reconcile_all(st, cuda, OverLimit::Refuse) {
        if let Err(undone) = unload() {
            vlog!(
                ERROR,
                "could not unload code refused by the limit ({undone:?}); it is charged"
            );
        }
        let _ = reconcile_all(st, cuda, OverLimit::Charge);
        return Err(log_oom(&oom));
    }
    Ok(())
}

/// `cuModuleLoad*` succeeded: charge the module, or unload it if the limit refuses.
///
/// # Safety
/// `module` is the out-pointer the driver just filled.
pub(crate) unsafe fn module_loaded(cuda: &Cuda, module: *mut CUmodule) -> Result<(), CUresult> {
    code_loaded(cuda, || {
        // SAFETY: the driver filled the out-pointer (a load fails on null).
        let m = unsafe { read_back(module) }.ok_or(CUresult::INVALID_VALUE)?;
        driver::module_unload(cuda, m)
    })
}

/// `cuLibraryLoad*` succeeded: charge the library, or unload it if the limit refuses.
///
/// # Safety
/// `library` is the out-pointer the driver just filled.
pub(crate) unsafe fn library_loaded(cuda: &Cuda, library: *mut CUlibrary) -> Result<(), CUresult> {
    code_loaded(cuda, || {
        // SAFETY: the driver filled the out-pointer (a load fails on null).
        let l = unsafe { read_back(library) }.ok_or(CUresult::INVALID_VALUE)?;
        driver::library_unload(cuda, l)
    })
}

/// After a module or library unload (or a context gone): give back what the driver freed.
pub(crate) fn code_unloaded(cuda: &Cuda) -> Result<(), CUresult> {
    if let Some(st) = ready_state() {
        let _ = reconcile_all(st, cuda, OverLimit::Charge);
    }
    Ok(())
}
