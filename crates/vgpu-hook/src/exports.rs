//! The exported C ABI, generated from the declaration lists of `vgpu-cuda-abi`: one
//! `#[no_mangle] extern "C"` function per hooked symbol, each building the program's call
//! as a forward to the real function and handing it to the implementation in
//! `crate::hooks` the entry's shape names (see `vgpu_cuda_abi`'s symbol docs), behind a
//! panic guard; the implementation's `Result` becomes the returned code. Plus `dlsym`, and
//! the `cuGetProcAddress` follow-up: the two lookups that hand out our exports' addresses
//! (the tables built here), decided by `crate::interpose`.
//!
//! The version script written by `build.rs` keeps exactly these symbols global.

use std::ffi::CStr;

use vgpu_cuda_abi::*;

use crate::ffi::{ExportAddrs, code, guard};
use crate::log::{DEBUG, vlog};
use crate::real::{self, Cuda, Nvml};

/// Where the shapes find each hook's implementation: `crate::hooks`, but for the
/// `cuGetProcAddress` follow-up, which hands out this module's own export addresses (so that
/// nothing below this module needs them).
mod implementations {
    pub(super) use super::proc_address_found;
    pub(super) use crate::hooks::*;
}

macro_rules! export_fns {
    ($list:ident, $lib:ident, $load:path, $missing:expr;
     $( $name:ident [$base:literal, $ver:literal, $kind:ident $(, $touches:ident)?] fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty
        $(=> $verb:ident $($target:ident)? $(($($shape_arg:ident),*))?)?; )*) => {
        $(
            #[doc = concat!("Exported `", stringify!($name), "`.")]
            ///
            /// # Safety
            /// The driver API's contract for this function.
            #[unsafe(no_mangle)]
            // A shape's implementation is an `unsafe fn` where it reads the caller's pointers.
            #[allow(unused_unsafe)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
                // The call in the swap gate: out of line, so that with swapping off (one
                // relaxed load) the export below is the call alone, as without the gate.
                #[cold]
                #[inline(never)]
                #[allow(dead_code, clippy::too_many_arguments)]
                unsafe fn gated($($arg: $ty),*) -> $ret {
                    let forward = move |lib: &$lib| -> Result<(), $ret> {
                        let real = lib.h.$name.ok_or($missing)?;
                        // SAFETY: as below.
                        unsafe { real($($arg),*) }.ok()
                    };
                    guard(stringify!($name), || {
                        code(swap_gate!(gated $($touches)?; ($($arg),*); shape!($name, $kind, $load, forward,
                            ($($arg),*) $(; $verb $($target)? $(($($shape_arg),*))?)?)))
                    })
                }
                if !swap_gate!(off $($touches)?) {
                    // SAFETY: the caller's arguments, passed on.
                    return unsafe { gated($($arg),*) };
                }
                let forward = move |lib: &$lib| -> Result<(), $ret> {
                    let real = lib.h.$name.ok_or($missing)?;
                    // SAFETY: the real function of exactly this signature (the declaration
                    // list), called as the caller called us: the caller's contract holds.
                    unsafe { real($($arg),*) }.ok()
                };
                guard(stringify!($name), || {
                    code(shape!($name, $kind, $load, forward, ($($arg),*)
                        $(; $verb $($target)? $(($($shape_arg),*))?)?))
                })
            }
        )*

        /// Our export's address for each entry of the list, in list order.
        pub(crate) static $list: ExportAddrs = ExportAddrs::new(&[$($name as *const (),)*]);
    };
}

/// The swap gate around the call, by the entry's gate (`vgpu_cuda_abi`'s symbol docs;
/// docs/swap.md): none, `touches` or `ends_context`. `off ...`: whether the export makes its
/// call without the gate (always for an entry without one; for the others while swapping is
/// off, one relaxed load); `gated ...`: the call in the gate.
macro_rules! swap_gate {
    (off) => {
        true
    };
    (off $gate:ident) => {
        crate::swap::off()
    };
    (gated; $args:tt; $call:expr) => {
        $call
    };
    (gated touches; $args:tt; $call:expr) => {
        crate::swap::touching(|| $call)
    };
    // An entry that ends a context has one argument: the context, or the primary's device.
    (gated ends_context; ($end:ident); $call:expr) => {
        crate::swap::ending_context($end, || $call)
    };
}

/// The call an export makes, by the entry's shape (`vgpu_cuda_abi`'s symbol docs).
macro_rules! shape {
    // Forward, nothing else (hooked for its gate).
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt; pass) => {
        $load().and_then(|lib| $forward(lib))
    };
    // Forward; on success the follow-up.
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt; then $f:ident ($($a:ident),*)) => {
        $load().and_then(|lib| {
            $forward(lib)?;
            // SAFETY: the follow-up reads the pointers the driver just accepted.
            unsafe { implementations::$f(lib, $($a),*) }
        })
    };
    // Forward; the follow-up whatever the answer.
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt; finally $f:ident ($($a:ident),*)) => {
        $load().and_then(|lib| {
            let answer = $forward(lib);
            implementations::$f(lib, $($a),*);
            answer
        })
    };
    // The `_ptsz` twin of a hand-written body.
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt; twin $y:ident $(($($a:ident),*))?) => {
        shape!(@call $y, $forward, $all $(, ($($a),*))?, StreamKind::PerThread)
    };
    // A hand-written body (shared by several symbols when named) given some arguments.
    ($name:ident, legacy, $load:path, $forward:ident, $all:tt; body $f:ident ($($a:ident),*)) => {
        shape!(@call $f, $forward, ($($a),*), StreamKind::Legacy)
    };
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt; body $f:ident ($($a:ident),*)) => {
        shape!(@call $f, $forward, ($($a),*))
    };
    ($name:ident, legacy, $load:path, $forward:ident, $all:tt; body ($($a:ident),*)) => {
        shape!(@call $name, $forward, ($($a),*), StreamKind::Legacy)
    };
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt; body ($($a:ident),*)) => {
        shape!(@call $name, $forward, ($($a),*))
    };
    // A hand-written body given every argument.
    ($name:ident, legacy, $load:path, $forward:ident, $all:tt) => {
        shape!(@call $name, $forward, $all, StreamKind::Legacy)
    };
    ($name:ident, $kind:ident, $load:path, $forward:ident, $all:tt) => {
        shape!(@call $name, $forward, $all)
    };
    (@call $f:ident, $forward:ident, $all:tt, ($($a:ident),*), $variant:expr) => {
        shape!(@call $f, $forward, ($($a),*), $variant)
    };
    (@call $f:ident, $forward:ident, ($($a:ident),*) $(, $variant:expr)?) => {
        // SAFETY: the caller's arguments under the driver's contract for this call.
        unsafe { implementations::$f($($variant,)? $forward, $($a),*) }
    };
}

macro_rules! cuda_exports {
    ($($t:tt)*) => { export_fns!(CUDA_EXPORTS, Cuda, real::cuda, CUresult::NOT_SUPPORTED; $($t)*); };
}
macro_rules! nvml_exports {
    ($($t:tt)*) => {
        export_fns!(NVML_EXPORTS, Nvml, real::nvml, nvmlReturn_t::FUNCTION_NOT_FOUND; $($t)*);
    };
}
cuda_hooked_functions!(with_shapes cuda_exports);
nvml_hooked_functions!(with_shapes nvml_exports);

/// Exported `dlsym`.
///
/// `dlsym(RTLD_NEXT, name)` searches the objects after the *caller's*, and glibc finds
/// the caller from the return address. So for `RTLD_NEXT` this stub jumps (not calls)
/// to the real `dlsym` with the original return address still on the stack: the lookup
/// behaves exactly as if we were not there. Other handles go to `dlsym_impl`, which
/// substitutes our wrappers for the hooked driver/NVML functions.
///
/// # Safety
/// `dlsym`'s contract: `handle` is a handle from `dlopen` or a pseudo-handle, `symbol`
/// a NUL-terminated string.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmp rdi, -1",     // RTLD_NEXT == (void *)-1
        "jne {imp}",
        "push rdi",
        "push rsi",
        "sub rsp, 8",      // keep the stack 16-byte aligned for the call
        "call {real}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        imp = sym dlsym_impl,
        real = sym real_dlsym_for_next,
    )
}

/// Exported `dlsym` (aarch64): `x0 == RTLD_NEXT` tail-branches to the real `dlsym` with the
/// caller's link register intact, as on x86_64.
///
/// # Safety
/// `dlsym`'s contract.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmn x0, #1",
        "b.eq 2f",
        "b {imp}", // b (±128 MiB, veneers allowed), not b.ne (±1 MiB)
        "2:",
        "stp x0, x1, [sp, #-32]!",
        "str x30, [sp, #16]",
        "bl {real}",
        "mov x16, x0",
        "ldr x30, [sp, #16]",
        "ldp x0, x1, [sp], #32",
        "br x16",
        imp = sym dlsym_impl,
        real = sym real_dlsym_for_next,
    )
}

/// The real `dlsym` for the `RTLD_NEXT` trampoline; never null (falls back to a function
/// answering "not found").
extern "C" fn real_dlsym_for_next() -> *const () {
    match crate::real::real_dlsym() {
        Some(f) => f as *const (),
        None => dlsym_not_found as *const (),
    }
}

extern "C" fn dlsym_not_found(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

/// `dlsym` for every handle but `RTLD_NEXT`: the real lookup, then our wrapper in place of a
/// hooked driver function.
extern "C" fn dlsym_impl(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real) = crate::real::real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: forwarded unchanged under dlsym's contract.
    let found = unsafe { real(handle, symbol) };
    if found.is_null() || symbol.is_null() || crate::real::in_loader() {
        return found;
    }
    // SAFETY: dlsym's contract: `symbol` is NUL-terminated (and the real dlsym just read it).
    let name = unsafe { CStr::from_ptr(symbol) };
    std::panic::catch_unwind(|| {
        crate::interpose::substitute_dlsym(name.to_bytes(), found, &CUDA_EXPORTS, &NVML_EXPORTS)
    })
    .unwrap_or(found)
}

/// `cuGetProcAddress[_v2]` succeeded: replaces `*pfn` (what the real one returned) by our
/// wrapper where hooked (a `then` follow-up, like those in `crate::hooks`).
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
    let ours =
        crate::interpose::substitute_proc_address(cuda, &CUDA_EXPORTS, name, found, version, flags);
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
