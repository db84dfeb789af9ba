//! Small unsafe helpers at the C boundary: out-pointer writes and in-pointer reads, the panic
//! guard, the table of our exports' addresses, and fresh anonymous memory of the hook's own.

use std::panic::{AssertUnwindSafe, catch_unwind};

use vgpu_cuda_abi::{CUresult, c_void, nvmlReturn_t};

use crate::log::{ERROR, vlog};

/// A C return code: a success value, and an "internal error" value for caught panics.
pub(crate) trait ReturnCode: Copy + std::fmt::Debug {
    /// Success.
    const SUCCESS: Self;
    /// Returned when the hook's own code panicked.
    const PANIC: Self;
}

impl ReturnCode for CUresult {
    const SUCCESS: Self = CUresult::SUCCESS;
    const PANIC: Self = CUresult::UNKNOWN;
}

impl ReturnCode for nvmlReturn_t {
    const SUCCESS: Self = nvmlReturn_t::SUCCESS;
    const PANIC: Self = nvmlReturn_t::UNKNOWN;
}

/// Runs an export's body, turning a panic into a logged error code: unwinding must never
/// cross into C.
#[inline(always)]
pub(crate) fn guard<R: ReturnCode>(name: &'static str, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(_) => {
            vlog!(
                ERROR,
                "internal error (panic) in {name}; returning {:?}",
                R::PANIC
            );
            R::PANIC
        }
    }
}

/// Stores `value` through a caller's out-pointer; `INVALID_VALUE` for null.
///
/// # Safety
/// `out` must be null or valid for a write of `T` (the driver API contract).
#[inline]
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: non-null and valid for writes per this function's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads a caller's in-pointer; `None` for null.
///
/// # Safety
/// `p` must be null or valid for a read of `T` (the driver API contract).
#[inline]
pub(crate) unsafe fn read_in<T: Copy>(p: *const T) -> Option<T> {
    // SAFETY: non-null pointers are valid for reads per this function's contract.
    (!p.is_null()).then(|| unsafe { p.read() })
}

/// Reads a caller's out-pointer after the real driver filled it.
///
/// # Safety
/// `p` must be null or valid for a read of `T`.
#[inline]
pub(crate) unsafe fn read_back<T: Copy>(p: *const T) -> Option<T> {
    // SAFETY: per this function's contract.
    unsafe { read_in(p) }
}

/// Collapses an implementation's `Result` into the code returned to C (an `Err` always
/// holds a failure code: it comes from `CUresult::ok` / `nvmlReturn_t::ok` or names one).
#[inline(always)]
pub(crate) fn code<R: ReturnCode>(r: Result<(), R>) -> R {
    match r {
        Ok(()) => R::SUCCESS,
        Err(e) => e,
    }
}

/// Addresses of our exported functions, indexed like their declaration list (`crate::exports`
/// builds one per list; `crate::interpose` hands them out).
#[derive(Debug)]
pub(crate) struct ExportAddrs(&'static [*const ()]);

// SAFETY: the table holds addresses of functions, immutable for the program's lifetime.
unsafe impl Sync for ExportAddrs {}

impl ExportAddrs {
    /// The table of `addrs`, in list order.
    pub(crate) const fn new(addrs: &'static [*const ()]) -> Self {
        Self(addrs)
    }

    /// The address of entry `index`.
    pub(crate) fn get(&self, index: usize) -> *mut c_void {
        self.0
            .get(index)
            .map_or(std::ptr::null_mut(), |p| p.cast_mut().cast())
    }

    /// Index of the export at `addr`, if it is one of ours.
    pub(crate) fn index_of(&self, addr: *mut c_void) -> Option<usize> {
        self.0.iter().position(|p| p.cast_mut().cast() == addr)
    }
}

/// A fresh private anonymous read-write mapping of `len` bytes where the kernel chooses
/// (zeroed, committed as touched), or `None` where the kernel refuses it. The caller owns it.
pub(crate) fn map_anonymous(len: usize) -> Option<*mut c_void> {
    // SAFETY: a new mapping where the kernel chooses names no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED && !p.is_null()).then_some(p.cast())
}
