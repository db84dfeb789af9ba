//! The few CUDA driver calls the workload and the probes make, reached the way most real
//! programs reach the driver: `dlopen("libcuda.so.1")` + `dlsym`. Under `LD_PRELOAD=libvgpu.so`
//! the hook's exported `dlsym` answers, so these calls go through the hook.
//!
//! All `unsafe` of this crate's driver access is in this module.

use std::ffi::{CStr, c_char, c_void};
use std::mem::ManuallyDrop;
use std::path::PathBuf;

use libloading::os::unix::{Library as Loaded, RTLD_LOCAL, RTLD_NOW};
use vgpu_cuda_abi::{CUcontext, CUdevice, CUdeviceptr, CUresult, c_int, pfn};

/// A loaded shared library. Never unloaded: unloading a driver under a running program is
/// unsafe, and the tool is short-lived.
#[derive(Debug)]
pub struct Library {
    lib: ManuallyDrop<Loaded>,
    /// The `dlopen` handle of `lib`, for `dladdr`/`dlinfo` (which libloading does not cover).
    handle: *mut c_void,
    name: String,
}

/// The loader's own words for a failure (libloading's `Display` says only "dlopen failed").
fn loader_error(e: &libloading::Error) -> String {
    std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string())
}

impl Library {
    /// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`: a name is searched like the loader does
    /// (`LD_LIBRARY_PATH`, cache), a path is taken as is. RTLD_NOW so a missing dependency
    /// shows here rather than at the first call.
    pub fn open(name: &str) -> Result<Self, String> {
        if name.contains('\0') {
            return Err(format!("{name:?} contains a NUL byte"));
        }
        // SAFETY: loading runs the library's initializers, which is the point (we check that
        // it loads); it is never unloaded, so no finalizer runs under us.
        let lib = unsafe { Loaded::open(Some(name), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| loader_error(&e))?;
        let handle = lib.into_raw();
        Ok(Self {
            // SAFETY: `handle` was just returned by `into_raw` of a loaded library.
            lib: ManuallyDrop::new(unsafe { Loaded::from_raw(handle) }),
            handle,
            name: name.to_owned(),
        })
    }

    /// The address of `symbol`, if the library (or what it depends on) defines it.
    pub fn symbol(&self, symbol: &str) -> Option<*mut c_void> {
        // SAFETY: only the address is taken, never used as a value of some type.
        let p = unsafe { self.lib.get::<*mut c_void>(symbol) }
            .ok()?
            .into_raw();
        (!p.is_null()).then_some(p)
    }

    /// The function `symbol` as a `T` (`None` if undefined or NULL). It goes through `dlsym`,
    /// so under `LD_PRELOAD=libvgpu.so` the hook's exported `dlsym` picks the function.
    ///
    /// # Safety
    /// `T` must be the `unsafe extern "C" fn` type of the C function of that name.
    unsafe fn function<T: Copy>(&self, symbol: &str) -> Option<T> {
        // SAFETY: the caller vouches for `T`; `Option<fn>` is pointer-sized, NULL is `None`.
        unsafe { self.lib.get::<Option<T>>(symbol) }
            .ok()
            .and_then(|f| *f)
    }

    /// As [`Self::function`], a missing symbol being an error naming it.
    ///
    /// # Safety
    /// As [`Self::function`].
    unsafe fn require<T: Copy>(&self, symbol: &str) -> Result<T, String> {
        // SAFETY: forwarded to the caller.
        unsafe { self.function(symbol) }
            .ok_or_else(|| format!("{} has no symbol {symbol}", self.name))
    }

    /// The file that defines `symbol` (which file the loader really picked).
    pub fn file_of(&self, symbol: &str) -> Option<PathBuf> {
        let addr = self.symbol(symbol)?;
        // SAFETY: Dl_info is plain data; zeroed is a valid initial value.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: addr is a symbol address in a loaded object; info is a valid out-pointer.
        if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
        let name = unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned();
        Some(std::fs::canonicalize(&name).unwrap_or_else(|_| PathBuf::from(name)))
    }

    /// The file the loader actually opened for this handle (after symlinks and search paths).
    pub fn path(&self) -> Option<PathBuf> {
        // The head of glibc's `struct link_map`; only `l_name` is read.
        #[repr(C)]
        struct LinkMapHead {
            _l_addr: usize,
            l_name: *const c_char,
        }
        let mut map: *const LinkMapHead = std::ptr::null();
        // SAFETY: handle is a live dlopen handle; RTLD_DI_LINKMAP stores a `struct link_map *`.
        let rc = unsafe { libc::dlinfo(self.handle, libc::RTLD_DI_LINKMAP, (&raw mut map).cast()) };
        if rc != 0 || map.is_null() {
            return None;
        }
        // SAFETY: the loader's link_map lives as long as the (never closed) handle.
        let name = unsafe { (*map).l_name };
        if name.is_null() {
            return None;
        }
        // SAFETY: l_name is a NUL-terminated path owned by the loader.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        Some(std::fs::canonicalize(&name).unwrap_or_else(|_| PathBuf::from(name)))
    }

    /// The name it was opened by.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A driver call that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CuError {
    /// Which call.
    pub call: &'static str,
    /// The `CUresult`.
    pub code: CUresult,
    /// The driver's name for it (`CUDA_ERROR_OUT_OF_MEMORY`), when it knows one.
    pub name: String,
}

impl std::fmt::Display for CuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, self.name, self.code.0)
    }
}

// Driver functions the CLI calls that vgpu-cuda-abi's lists do not declare (the hook neither
// intercepts nor calls them), in vgpu-cuda-abi's types.
/// `cuDeviceGetName(char *name, int len, CUdevice dev)`.
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult;
/// `cuCtxSetCurrent(CUcontext ctx)`.
type CuCtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuGetErrorName(CUresult error, const char **name)`.
type CuGetErrorName = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;

/// The driver entry points the workload uses, resolved once.
#[derive(Debug)]
pub struct Driver {
    lib: Library,
    init: pfn::cuInit,
    driver_get_version: pfn::cuDriverGetVersion,
    device_get_count: pfn::cuDeviceGetCount,
    device_get: pfn::cuDeviceGet,
    device_get_name: CuDeviceGetName,
    device_total_mem: pfn::cuDeviceTotalMem_v2,
    primary_ctx_retain: pfn::cuDevicePrimaryCtxRetain,
    ctx_set_current: CuCtxSetCurrent,
    mem_alloc: pfn::cuMemAlloc_v2,
    mem_free: pfn::cuMemFree_v2,
    mem_get_info: pfn::cuMemGetInfo_v2,
    get_error_name: Option<CuGetErrorName>,
}

impl Driver {
    /// Open the driver library (`libcuda.so.1` normally) and resolve the entry points.
    pub fn open(name: &str) -> Result<Self, String> {
        let lib = Library::open(name)?;
        // SAFETY: each field's type is the C signature of the driver function of that name.
        unsafe {
            Ok(Self {
                init: lib.require("cuInit")?,
                driver_get_version: lib.require("cuDriverGetVersion")?,
                device_get_count: lib.require("cuDeviceGetCount")?,
                device_get: lib.require("cuDeviceGet")?,
                device_get_name: lib.require("cuDeviceGetName")?,
                device_total_mem: lib.require("cuDeviceTotalMem_v2")?,
                primary_ctx_retain: lib.require("cuDevicePrimaryCtxRetain")?,
                ctx_set_current: lib.require("cuCtxSetCurrent")?,
                mem_alloc: lib.require("cuMemAlloc_v2")?,
                mem_free: lib.require("cuMemFree_v2")?,
                mem_get_info: lib.require("cuMemGetInfo_v2")?,
                get_error_name: lib.function("cuGetErrorName"),
                lib,
            })
        }
    }

    /// The library the driver was loaded from.
    pub fn library(&self) -> &Library {
        &self.lib
    }

    fn check(&self, call: &'static str, code: CUresult) -> Result<(), CuError> {
        if code.is_success() {
            return Ok(());
        }
        let mut name = format!("CUresult {}", code.0);
        if let Some(f) = self.get_error_name {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: f is cuGetErrorName; p is a valid out-pointer.
            if unsafe { f(code, &mut p) }.is_success() && !p.is_null() {
                // SAFETY: the driver returns a static NUL-terminated string.
                name = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            }
        }
        Err(CuError { call, code, name })
    }

    /// The value a call writes through its out-pointer, if it succeeds.
    fn output<T: Default>(
        &self,
        call: &'static str,
        f: impl FnOnce(&mut T) -> CUresult,
    ) -> Result<T, CuError> {
        let mut value = T::default();
        self.check(call, f(&mut value))?;
        Ok(value)
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> Result<(), CuError> {
        // SAFETY: cuInit takes flags by value.
        self.check("cuInit", unsafe { (self.init)(0) })
    }

    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub fn driver_version(&self) -> Result<i32, CuError> {
        // SAFETY: valid out-pointer.
        self.output("cuDriverGetVersion", |v| unsafe {
            (self.driver_get_version)(v)
        })
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<i32, CuError> {
        // SAFETY: valid out-pointer.
        self.output("cuDeviceGetCount", |n| unsafe {
            (self.device_get_count)(n)
        })
    }

    /// `cuDeviceGet(ordinal)`.
    pub fn device(&self, ordinal: i32) -> Result<CUdevice, CuError> {
        // SAFETY: valid out-pointer.
        self.output("cuDeviceGet", |d| unsafe { (self.device_get)(d, ordinal) })
    }

    /// `cuDeviceGetName`.
    pub fn device_name(&self, device: CUdevice) -> Result<String, CuError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: buf is writable for its length, which we pass.
        self.check("cuDeviceGetName", unsafe {
            (self.device_get_name)(buf.as_mut_ptr(), 256, device)
        })?;
        buf[255] = 0;
        // SAFETY: NUL-terminated (forced above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuDeviceTotalMem_v2`: the limit under the hook, the physical total without.
    pub fn device_total_mem(&self, device: CUdevice) -> Result<u64, CuError> {
        // SAFETY: valid out-pointer.
        let total: usize = self.output("cuDeviceTotalMem_v2", |t| unsafe {
            (self.device_total_mem)(t, device)
        })?;
        Ok(total as u64)
    }

    /// Retain the device's primary context and make it current on this thread.
    pub fn use_primary_context(&self, device: CUdevice) -> Result<(), CuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context stays retained for the process's life.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.primary_ctx_retain)(&mut ctx, device)
        })?;
        // SAFETY: ctx was just returned by the driver.
        self.check("cuCtxSetCurrent", unsafe { (self.ctx_set_current)(ctx) })
    }

    /// `cuMemAlloc_v2(bytes)`: a device pointer.
    pub fn mem_alloc(&self, bytes: u64) -> Result<CUdeviceptr, CuError> {
        let size = usize::try_from(bytes).map_err(|_| CuError {
            call: "cuMemAlloc_v2",
            code: CUresult::OUT_OF_MEMORY,
            name: "request does not fit in size_t".into(),
        })?;
        // SAFETY: valid out-pointer.
        self.output("cuMemAlloc_v2", |p| unsafe { (self.mem_alloc)(p, size) })
    }

    /// `cuMemFree_v2(ptr)`.
    pub fn mem_free(&self, ptr: CUdeviceptr) -> Result<(), CuError> {
        // SAFETY: the driver validates the pointer and returns an error for a bad one.
        self.check("cuMemFree_v2", unsafe { (self.mem_free)(ptr) })
    }

    /// `cuMemGetInfo_v2`: (free, total) of the current context's device.
    pub fn mem_get_info(&self) -> Result<(u64, u64), CuError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        self.check("cuMemGetInfo_v2", unsafe {
            (self.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_failures_are_reported_in_the_loaders_words() {
        let e = Library::open("libvgpu-no-such-library.so.7").unwrap_err();
        assert!(e.contains("libvgpu-no-such-library.so.7"), "{e}");
        assert!(Library::open("a\0b").unwrap_err().contains("NUL"));
        let e = Driver::open("libc.so.6").unwrap_err();
        assert_eq!(e, "libc.so.6 has no symbol cuInit");
    }

    #[test]
    fn symbols_resolve_to_the_file_that_defines_them() {
        let libc = Library::open("libc.so.6").unwrap();
        assert!(libc.symbol("getpid").is_some());
        assert!(libc.symbol("vgpu_no_such_symbol").is_none());
        let file = libc.file_of("getpid").unwrap();
        assert_eq!(libc.path(), Some(file.clone()));
        assert!(
            file.to_string_lossy().contains("libc"),
            "{}",
            file.display()
        );
    }
}
