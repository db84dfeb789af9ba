//! Modules and libraries: their code takes device memory, charged as module memory by
//! reconciling with NVML's per-process used memory after each load and unload.

use super::*;

/// After a module or library load: charge what it put on the device; a load whose memory
/// the limit refuses is undone and fails with `CUDA_ERROR_OUT_OF_MEMORY`.
pub(super) fn after_code_load(r: CUresult, unload: impl FnOnce() -> CUresult) -> CUresult {
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
pub(super) fn unload_module(cuda: &Cuda, module: *mut CUmodule) -> CUresult {
    // SAFETY: the driver filled the out-pointer (a load fails on null).
    let Some(m) = (unsafe { read_back(module) }) else {
        return CUresult::INVALID_VALUE;
    };
    call!(cuda, h.cuModuleUnload(m))
}

/// Unloads the library a successful load wrote to `library` (refused by the limit).
pub(super) fn unload_library(cuda: &Cuda, library: *mut CUlibrary) -> CUresult {
    // SAFETY: the driver filled the out-pointer (a load fails on null).
    let Some(l) = (unsafe { read_back(library) }) else {
        return CUresult::INVALID_VALUE;
    };
    call!(cuda, h.cuLibraryUnload(l))
}

/// After a module or library unload (or a context gone): give back what the driver freed.
pub(super) fn after_code_unload(r: CUresult) -> CUresult {
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
