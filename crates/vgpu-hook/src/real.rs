//! The real driver: `libcuda.so.1` and `libnvidia-ml.so.1` loaded with the real `dlsym`.
//!
//! Initialization is lazy and lock-free: a thread that finds a table missing builds one
//! (dlopen/dlsym take the loader's own lock, never ours) and publishes it in a
//! [`Published`] cell; a losing thread drops its copy. So no thread ever waits on us while
//! holding the loader lock.
//!
//! A thread-local guard marks "inside our loader calls": the `dlsym` export passes lookups
//! straight through while it is set, because loading a library runs its constructors,
//! which may call `dlsym` again.

use std::cell::Cell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use vgpu_cuda_abi::*;

use crate::log::{ERROR, vlog};
use crate::published::Published;

/// `dlsym`'s C signature.
pub(crate) type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// The C library's `dlsym` (not ours), found with `dlvsym(RTLD_NEXT, ...)`.
pub(crate) fn real_dlsym() -> Option<DlsymFn> {
    let cached = REAL_DLSYM.load(Ordering::Acquire);
    if cached != 0 {
        // SAFETY: only ever stores a non-null `dlsym` address returned by `dlvsym`.
        return Some(unsafe { std::mem::transmute::<usize, DlsymFn>(cached) });
    }
    // glibc ≥ 2.34 defines dlsym@GLIBC_2.34 in libc; older ones dlsym@GLIBC_2.2.5
    // (x86_64) or @GLIBC_2.17 (aarch64) in libdl.
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: dlvsym with valid NUL-terminated strings; RTLD_NEXT searches the objects
        // loaded after this library, where the C library's dlsym lives.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !p.is_null() {
            REAL_DLSYM.store(p as usize, Ordering::Release);
            // SAFETY: `p` is the address of the C library's dlsym, which has this signature.
            return Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) });
        }
    }
    None
}

thread_local! {
    static IN_LOADER: Cell<bool> = const { Cell::new(false) };
}

/// True while this thread is inside our own dlopen/dlsym work.
pub(crate) fn in_loader() -> bool {
    IN_LOADER.with(|f| f.get())
}

struct LoaderGuard;
impl LoaderGuard {
    fn enter() -> Option<Self> {
        IN_LOADER.with(|f| {
            if f.replace(true) {
                None
            } else {
                Some(LoaderGuard)
            }
        })
    }
}
impl Drop for LoaderGuard {
    fn drop(&mut self) {
        IN_LOADER.with(|f| f.set(false));
    }
}

macro_rules! fn_table {
    ($table:ident; $( $name:ident [$base:literal, $ver:literal, $kind:ident $(, $touches:ident)?] fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty; )*) => {
        /// Real entry points (`None` where the library lacks the symbol).
        #[derive(Debug, Clone, Copy)]
        pub(crate) struct $table {
            $(pub(crate) $name: Option<pfn::$name>,)*
        }

        impl FnTable for $table {
            fn resolve(dlsym: DlsymFn, lib: *mut c_void) -> Self {
                Self {$(
                    // SAFETY: dlsym on a live handle with a NUL-terminated name; a non-null
                    // result is the library's function of exactly this C signature (the
                    // declaration list is checked against the driver headers), and
                    // Option<fn> has the null pointer as None.
                    $name: unsafe {
                        std::mem::transmute::<*mut c_void, Option<pfn::$name>>(
                            dlsym(lib, concat!(stringify!($name), "\0").as_ptr().cast()),
                        )
                    },
                )*}
            }

            fn addresses(&self) -> Vec<usize> {
                vec![$(self.$name.map_or(0, |f| f as usize),)*]
            }
        }

        impl $table {
            /// A table with no functions (tests).
            #[cfg(test)]
            #[allow(dead_code)]
            fn none() -> Self {
                Self {$($name: None,)*}
            }
        }
    };
}

/// A table of real entry points, as [`fn_table!`] generates one from the declaration list.
pub(crate) trait FnTable {
    /// Resolves every entry in `lib` with the real dlsym.
    fn resolve(dlsym: DlsymFn, lib: *mut c_void) -> Self;
    /// The real address of every entry (0 where absent), in declaration-list order.
    fn addresses(&self) -> Vec<usize>;
}

macro_rules! cuda_hooked_table { ($($t:tt)*) => { fn_table!(CudaHooked; $($t)*); }; }
macro_rules! cuda_used_table { ($($t:tt)*) => { fn_table!(CudaUsed; $($t)*); }; }
macro_rules! nvml_hooked_table { ($($t:tt)*) => { fn_table!(NvmlHooked; $($t)*); }; }
macro_rules! nvml_used_table { ($($t:tt)*) => { fn_table!(NvmlUsed; $($t)*); }; }
cuda_hooked_functions!(cuda_hooked_table);
cuda_used_functions!(cuda_used_table);
nvml_hooked_functions!(nvml_hooked_table);
nvml_used_functions!(nvml_used_table);

/// A real library: the functions we hook (`H`, what our wrappers forward to) and the ones we
/// call without hooking (`U`).
#[derive(Debug)]
pub(crate) struct Library<H, U> {
    /// Hooked functions.
    pub(crate) h: H,
    /// Functions we call without hooking.
    pub(crate) u: U,
    /// The `dlopen` handle.
    handle: usize,
    /// Real address of each entry of the library's hooked symbols (`CUDA_HOOKED_SYMBOLS`,
    /// `NVML_HOOKED_SYMBOLS`; 0 if absent).
    hooked_addrs: Vec<usize>,
}

/// The real CUDA driver.
pub(crate) type Cuda = Library<CudaHooked, CudaUsed>;
/// The real NVML library.
pub(crate) type Nvml = Library<NvmlHooked, NvmlUsed>;

impl<H, U> Library<H, U> {
    /// Index into the hooked symbols of the one whose real address is `addr`.
    pub(crate) fn hooked_index_of(&self, addr: usize) -> Option<usize> {
        if addr == 0 {
            return None;
        }
        self.hooked_addrs.iter().position(|&a| a == addr)
    }

    /// Real address of hooked symbol `index` (0 if the library lacks it).
    pub(crate) fn hooked_addr(&self, index: usize) -> usize {
        self.hooked_addrs.get(index).copied().unwrap_or(0)
    }

    /// Whether `handle` is the handle we hold for the library.
    #[allow(dead_code)]
    pub(crate) fn is_handle(&self, handle: *mut c_void) -> bool {
        handle as usize == self.handle
    }
}

impl<H: FnTable, U: FnTable> Library<H, U> {
    /// Opens `name` and resolves both tables in it; `Err` with `dlerror()`'s reason when it
    /// does not open.
    fn open(name: &CStr) -> Result<Self, String> {
        let Some((dlsym, lib)) = open(name) else {
            return Err(dlerror());
        };
        let h = H::resolve(dlsym, lib);
        Ok(Self {
            hooked_addrs: h.addresses(),
            h,
            u: U::resolve(dlsym, lib),
            handle: lib as usize,
        })
    }
}

impl Cuda {
    /// A driver whose hooked symbols live at `hooked_addrs` (tests of the lookup logic).
    #[cfg(test)]
    pub(crate) fn fake(hooked_addrs: Vec<usize>) -> Self {
        Cuda {
            h: CudaHooked::none(),
            u: CudaUsed::none(),
            handle: 0,
            hooked_addrs,
        }
    }
}

/// Name of the real driver library.
pub(crate) const LIBCUDA: &CStr = c"libcuda.so.1";
/// Name of the real NVML library.
pub(crate) const LIBNVML: &CStr = c"libnvidia-ml.so.1";

static CUDA: Published<Cuda> = Published::new();
static NVML: Published<Nvml> = Published::new();

fn open(name: &CStr) -> Option<(DlsymFn, *mut c_void)> {
    let dlsym = real_dlsym()?;
    // SAFETY: dlopen with a NUL-terminated name. RTLD_LOCAL: we must not change which
    // definitions the program's own later lookups find.
    let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        None
    } else {
        Some((dlsym, lib))
    }
}

/// The real driver, loading it on first use. `Err` when it cannot be loaded (logged once)
/// or when called re-entrantly from inside our own loading.
pub(crate) fn cuda() -> Result<&'static Cuda, CUresult> {
    match CUDA.get() {
        Some(cuda) => Ok(cuda),
        None => load(&CUDA, LIBCUDA, CUresult::NOT_INITIALIZED, |why| {
            static LOGGED: AtomicUsize = AtomicUsize::new(0);
            if LOGGED.swap(1, Ordering::Relaxed) == 0 {
                let lib = LIBCUDA.to_string_lossy();
                vlog!(ERROR, "cannot load the real driver {lib}: {why}");
            }
            CUresult::NOT_INITIALIZED
        }),
    }
}

/// Real NVML, loading it on first use.
pub(crate) fn nvml() -> Result<&'static Nvml, nvmlReturn_t> {
    match NVML.get() {
        Some(nvml) => Ok(nvml),
        None => load(&NVML, LIBNVML, nvmlReturn_t::UNINITIALIZED, |why| {
            vlog!(ERROR, "cannot load {}: {why}", LIBNVML.to_string_lossy());
            nvmlReturn_t::LIBRARY_NOT_FOUND
        }),
    }
}

/// Loads library `name` into `cell` under the loader guard: `reentered` when this thread is
/// already loading (a hook reached from inside `dlopen`), `failed(dlerror)` when it does not
/// open. A losing thread's extra dlopen reference is harmless (the library stays loaded).
#[cold]
fn load<H: FnTable, U: FnTable, E>(
    cell: &'static Published<Library<H, U>>,
    name: &CStr,
    reentered: E,
    failed: impl FnOnce(String) -> E,
) -> Result<&'static Library<H, U>, E> {
    let Some(_guard) = LoaderGuard::enter() else {
        return Err(reentered);
    };
    match Library::open(name) {
        Ok(table) => Ok(cell.publish(table)),
        Err(why) => Err(failed(why)),
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated thread-local message.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null dlerror() result is a valid C string until the next dl call.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}
