//! The few CUDA driver calls the workload and the probes make, reached the way most real
//! programs reach the driver: `dlopen("libcuda.so.1")` + `dlsym`. Under `LD_PRELOAD=libvgpu.so`
//! the hook's exported `dlsym` answers, so these calls go through the hook.
//!
//! All `unsafe` of this crate's driver access is in this module.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::path::PathBuf;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: i32 = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// A loaded shared library. Never unloaded: unloading a driver under a running program is
/// unsafe, and the tool is short-lived.
#[derive(Debug)]
pub struct Library {
    handle: *mut c_void,
    name: String,
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a valid C string owned by the loader, read at once.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown loader error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Library {
    /// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`: a name is searched like the loader does
    /// (`LD_LIBRARY_PATH`, cache), a path is taken as is. RTLD_NOW so a missing dependency
    /// shows here rather than at the first call.
    pub fn open(name: &str) -> Result<Self, String> {
        let c = CString::new(name).map_err(|_| format!("{name:?} contains a NUL byte"))?;
        // SAFETY: `c` is a valid C string; loading runs the library's initializers, which is
        // the point (we check that it loads).
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dlerror_text());
        }
        Ok(Self {
            handle,
            name: name.to_owned(),
        })
    }

    /// The address of `symbol`, if the library (or what it depends on) defines it.
    pub fn symbol(&self, symbol: &str) -> Option<*mut c_void> {
        let c = CString::new(symbol).ok()?;
        // SAFETY: handle came from a successful dlopen and is never closed.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
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
    pub code: i32,
    /// The driver's name for it (`CUDA_ERROR_OUT_OF_MEMORY`), when it knows one.
    pub name: String,
}

impl std::fmt::Display for CuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, self.name, self.code)
    }
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type CuPrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuCtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type CuMemFree = unsafe extern "C" fn(u64) -> c_int;
type CuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
type CuGetErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// The driver entry points the workload uses, resolved once.
#[derive(Debug)]
pub struct Driver {
    lib: Library,
    init: CuInit,
    driver_get_version: CuDriverGetVersion,
    device_get_count: CuDeviceGetCount,
    device_get: CuDeviceGet,
    device_get_name: CuDeviceGetName,
    device_total_mem: CuDeviceTotalMem,
    primary_ctx_retain: CuPrimaryCtxRetain,
    ctx_set_current: CuCtxSetCurrent,
    mem_alloc: CuMemAlloc,
    mem_free: CuMemFree,
    mem_get_info: CuMemGetInfo,
    get_error_name: Option<CuGetErrorName>,
}

macro_rules! resolve {
    ($lib:expr, $name:literal, $ty:ty) => {{
        let p = $lib
            .symbol($name)
            .ok_or_else(|| format!("{} has no symbol {}", $lib.name(), $name))?;
        // SAFETY: the symbol is the driver function of that name, whose C signature $ty mirrors.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

impl Driver {
    /// Open the driver library (`libcuda.so.1` normally) and resolve the entry points.
    pub fn open(name: &str) -> Result<Self, String> {
        let lib = Library::open(name)?;
        let get_error_name = lib.symbol("cuGetErrorName").map(|p| {
            // SAFETY: as in resolve!: cuGetErrorName(CUresult, const char**).
            unsafe { std::mem::transmute::<*mut c_void, CuGetErrorName>(p) }
        });
        Ok(Self {
            init: resolve!(lib, "cuInit", CuInit),
            driver_get_version: resolve!(lib, "cuDriverGetVersion", CuDriverGetVersion),
            device_get_count: resolve!(lib, "cuDeviceGetCount", CuDeviceGetCount),
            device_get: resolve!(lib, "cuDeviceGet", CuDeviceGet),
            device_get_name: resolve!(lib, "cuDeviceGetName", CuDeviceGetName),
            device_total_mem: resolve!(lib, "cuDeviceTotalMem_v2", CuDeviceTotalMem),
            primary_ctx_retain: resolve!(lib, "cuDevicePrimaryCtxRetain", CuPrimaryCtxRetain),
            ctx_set_current: resolve!(lib, "cuCtxSetCurrent", CuCtxSetCurrent),
            mem_alloc: resolve!(lib, "cuMemAlloc_v2", CuMemAlloc),
            mem_free: resolve!(lib, "cuMemFree_v2", CuMemFree),
            mem_get_info: resolve!(lib, "cuMemGetInfo_v2", CuMemGetInfo),
            get_error_name,
            lib,
        })
    }

    /// The library the driver was loaded from.
    pub fn library(&self) -> &Library {
        &self.lib
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<(), CuError> {
        if code == CUDA_SUCCESS {
            return Ok(());
        }
        let mut name = format!("CUresult {code}");
        if let Some(f) = self.get_error_name {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: f is cuGetErrorName; p is a valid out-pointer.
            if unsafe { f(code, &mut p) } == CUDA_SUCCESS && !p.is_null() {
                // SAFETY: the driver returns a static NUL-terminated string.
                name = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            }
        }
        Err(CuError { call, code, name })
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> Result<(), CuError> {
        // SAFETY: cuInit takes flags by value.
        self.check("cuInit", unsafe { (self.init)(0) })
    }

    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub fn driver_version(&self) -> Result<i32, CuError> {
        let mut v = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDriverGetVersion", unsafe {
            (self.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<i32, CuError> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    /// `cuDeviceGet(ordinal)`.
    pub fn device(&self, ordinal: i32) -> Result<i32, CuError> {
        let mut d = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGet", unsafe { (self.device_get)(&mut d, ordinal) })?;
        Ok(d)
    }

    /// `cuDeviceGetName`.
    pub fn device_name(&self, device: i32) -> Result<String, CuError> {
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
    pub fn device_total_mem(&self, device: i32) -> Result<u64, CuError> {
        let mut total = 0usize;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.device_total_mem)(&mut total, device)
        })?;
        Ok(total as u64)
    }

    /// Retain the device's primary context and make it current on this thread.
    pub fn use_primary_context(&self, device: i32) -> Result<(), CuError> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context stays retained for the process's life.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.primary_ctx_retain)(&mut ctx, device)
        })?;
        // SAFETY: ctx was just returned by the driver.
        self.check("cuCtxSetCurrent", unsafe { (self.ctx_set_current)(ctx) })
    }

    /// `cuMemAlloc_v2(bytes)`: a device pointer.
    pub fn mem_alloc(&self, bytes: u64) -> Result<u64, CuError> {
        let size = usize::try_from(bytes).map_err(|_| CuError {
            call: "cuMemAlloc_v2",
            code: CUDA_ERROR_OUT_OF_MEMORY,
            name: "request does not fit in size_t".into(),
        })?;
        let mut ptr = 0u64;
        // SAFETY: valid out-pointer.
        self.check("cuMemAlloc_v2", unsafe { (self.mem_alloc)(&mut ptr, size) })?;
        Ok(ptr)
    }

    /// `cuMemFree_v2(ptr)`.
    pub fn mem_free(&self, ptr: u64) -> Result<(), CuError> {
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
