//! The exported NVML API, over the same state as the driver (one library serves both names).
//!
//! NVML sees every physical device, whatever `CUDA_VISIBLE_DEVICES` says, as the real one does.

#![allow(non_snake_case)]

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use vgpu_cuda_abi::{
    NVML_MEMORY_V2_VERSION, c_char, c_int, c_uint, c_ulonglong, nvmlDevice_t, nvmlMemory_t,
    nvmlMemory_v2_t, nvmlProcessInfo_t, nvmlProcessUtilizationSample_t, nvmlReturn_t,
    nvmlUtilization_t,
};

use crate::codes::*;
use crate::machine::format_uuid;
use crate::state::{Sim, global};

static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

/// Names of every NVML export.
pub const NVML_EXPORTS: &[&str] = &[
    "nvmlInit",
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
];

type NResult<T> = Result<T, u32>;

/// NVML device queries made by this process (every export of `nvml_exports!`), so tests can
/// check that a path makes none.
static QUERIES: AtomicU64 = AtomicU64::new(0);

/// How many NVML device queries this process has made (test instrumentation, not NVML API).
#[unsafe(no_mangle)]
pub extern "C" fn vgpusim_nvml_queries() -> u64 {
    QUERIES.load(Ordering::Relaxed)
}

fn run(f: impl FnOnce(&'static Sim) -> NResult<()>) -> nvmlReturn_t {
    QUERIES.fetch_add(1, Ordering::Relaxed);
    let r = catch_unwind(AssertUnwindSafe(|| {
        if INIT_COUNT.load(Ordering::Acquire) == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        let s = global().map_err(|_| NVML_ERROR_UNINITIALIZED)?;
        f(s)
    }));
    nvmlReturn_t(match r {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(c)) => c,
        Err(_) => NVML_ERROR_UNKNOWN,
    })
}

/// Writes an out-parameter, rejecting null with `NVML_ERROR_INVALID_ARGUMENT`.
macro_rules! put {
    ($p:expr, $v:expr) => {
        write_out!($p, $v, NVML_ERROR_INVALID_ARGUMENT)
    };
}

const NVML_TAG: usize = 0xd;

fn dev_handle(p: usize) -> nvmlDevice_t {
    (((p + 1) << 4) | NVML_TAG) as nvmlDevice_t
}

fn dev_index(s: &Sim, d: nvmlDevice_t) -> NResult<usize> {
    let v = d as usize;
    if v & 0xf != NVML_TAG || v >> 4 == 0 || (v >> 4) > s.devices.len() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok((v >> 4) - 1)
}

fn text_into(buf: *mut c_char, len: c_uint, text: &str) -> NResult<()> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if text.len() + 1 > len as usize {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` holds `len` bytes, enough for the text and its NUL (checked above).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(())
}

/// `nvmlProcessInfo_v1_t` (16 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ProcessInfoV1 {
    /// Process id.
    pub pid: c_uint,
    /// Bytes it uses on the device.
    pub used_gpu_memory: u64,
}

const _: () = assert!(std::mem::size_of::<ProcessInfoV1>() == 16);

fn init() -> nvmlReturn_t {
    match global() {
        Ok(_) => {
            INIT_COUNT.fetch_add(1, Ordering::AcqRel);
            nvmlReturn_t(NVML_SUCCESS)
        }
        Err(_) => nvmlReturn_t(NVML_ERROR_UNKNOWN),
    }
}

/// `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init()
}

/// `nvmlInit`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    init()
}

/// `nvmlInitWithFlags`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init()
}

/// `nvmlShutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    match INIT_COUNT.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)) {
        Ok(_) => nvmlReturn_t(NVML_SUCCESS),
        Err(_) => nvmlReturn_t(NVML_ERROR_UNINITIALIZED),
    }
}

/// `nvmlErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(r: nvmlReturn_t) -> *const c_char {
    nvml_error(r.0).as_ptr().cast()
}

macro_rules! nvml_exports {
    ($( $name:ident ( $($a:ident : $t:ty),* ) |$s:ident| $body:block )*) => {$(
        #[doc = concat!("The simulated NVML's `", stringify!($name), "`.")]
        ///
        /// # Safety
        /// Pointer arguments as the NVML API requires.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> nvmlReturn_t {
            run(|$s| $body)
        }
    )*};
}

fn processes<T>(
    s: &Sim,
    d: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    make: impl Fn(u32, u64) -> T,
) -> NResult<()> {
    let p = dev_index(s, d)?;
    let (used, present) = s.process_usage(p);
    let n = present as c_uint;
    if count.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: `count` is a valid in/out parameter (checked non-null).
    let cap = unsafe { *count };
    put!(count, n);
    if n == 0 {
        return Ok(());
    }
    if cap < n || infos.is_null() {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    put!(infos, make(s.nvml_pid(), used));
    Ok(())
}

nvml_exports! {
    nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) |s| {
        text_into(buf, len, &s.cfg.nvml_driver_version)
    }
    nvmlSystemGetCudaDriverVersion(v: *mut c_int) |s| {
        put!(v, s.cfg.driver_version);
        Ok(())
    }
    nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) |s| {
        put!(v, s.cfg.driver_version);
        Ok(())
    }
    nvmlDeviceGetCount(n: *mut c_uint) |s| {
        put!(n, s.devices.len() as c_uint);
        Ok(())
    }
    nvmlDeviceGetCount_v2(n: *mut c_uint) |s| {
        put!(n, s.devices.len() as c_uint);
        Ok(())
    }
    nvmlDeviceGetHandleByIndex(i: c_uint, d: *mut nvmlDevice_t) |s| {
        if i as usize >= s.devices.len() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put!(d, dev_handle(i as usize));
        Ok(())
    }
    nvmlDeviceGetHandleByIndex_v2(i: c_uint, d: *mut nvmlDevice_t) |s| {
        if i as usize >= s.devices.len() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        put!(d, dev_handle(i as usize));
        Ok(())
    }
    nvmlDeviceGetHandleByUUID(uuid: *const c_char, d: *mut nvmlDevice_t) |s| {
        if uuid.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: a NUL-terminated string from the caller.
        let want = unsafe { CStr::from_ptr(uuid) }.to_string_lossy().to_ascii_lowercase();
        let p = (0..s.devices.len())
            .find(|&p| format_uuid(&s.devices[p].uuid).to_ascii_lowercase() == want)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        put!(d, dev_handle(p));
        Ok(())
    }
    nvmlDeviceGetIndex(d: nvmlDevice_t, i: *mut c_uint) |s| {
        put!(i, dev_index(s, d)? as c_uint);
        Ok(())
    }
    nvmlDeviceGetMinorNumber(d: nvmlDevice_t, i: *mut c_uint) |s| {
        put!(i, dev_index(s, d)? as c_uint);
        Ok(())
    }
    nvmlDeviceGetName(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) |s| {
        dev_index(s, d)?;
        text_into(buf, len, &s.cfg.name)
    }
    nvmlDeviceGetUUID(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) |s| {
        let p = dev_index(s, d)?;
        text_into(buf, len, &format_uuid(&s.devices[p].uuid))
    }
    nvmlDeviceGetMemoryInfo(d: nvmlDevice_t, m: *mut nvmlMemory_t) |s| {
        let (total, free, used) = s.nvml_memory(dev_index(s, d)?);
        put!(m, nvmlMemory_t { total, free, used });
        Ok(())
    }
    nvmlDeviceGetMemoryInfo_v2(d: nvmlDevice_t, m: *mut nvmlMemory_v2_t) |s| {
        let (total, free, used) = s.nvml_memory(dev_index(s, d)?);
        if m.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and the caller must set `version` before the call.
        if unsafe { (*m).version } != NVML_MEMORY_V2_VERSION {
            return Err(25); // NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        }
        put!(m, nvmlMemory_v2_t { version: NVML_MEMORY_V2_VERSION, total, reserved: 0, free, used });
        Ok(())
    }
    nvmlDeviceGetUtilizationRates(d: nvmlDevice_t, u: *mut nvmlUtilization_t) |s| {
        let p = dev_index(s, d)?;
        let gpu = s.devices[p].busy.percent(Duration::from_millis(s.cfg.util_window_ms));
        put!(u, nvmlUtilization_t { gpu, memory: 0 });
        Ok(())
    }
    nvmlDeviceGetTotalEnergyConsumption(d: nvmlDevice_t, mj: *mut c_ulonglong) |s| {
        let p = dev_index(s, d)?;
        // A slow query, as on real GPUs (no lock of the simulator is held meanwhile).
        if s.cfg.nvml_energy_delay_ms > 0 {
            std::thread::sleep(Duration::from_millis(s.cfg.nvml_energy_delay_ms));
        }
        put!(mj, s.devices[p].busy.energy_mj());
        Ok(())
    }
    nvmlDeviceGetEnforcedPowerLimit(d: nvmlDevice_t, mw: *mut c_uint) |s| {
        let p = dev_index(s, d)?;
        put!(mw, s.devices[p].busy.power_limit_mw());
        Ok(())
    }
    nvmlDeviceGetPowerUsage(d: nvmlDevice_t, mw: *mut c_uint) |s| {
        let p = dev_index(s, d)?;
        put!(mw, s.devices[p].busy.power_draw_mw());
        Ok(())
    }
    nvmlDeviceGetProcessUtilization(d: nvmlDevice_t, samples: *mut nvmlProcessUtilizationSample_t, count: *mut c_uint, _last_seen: u64) |s| {
        let p = dev_index(s, d)?;
        let sm = s.devices[p].busy.percent(Duration::from_millis(s.cfg.util_window_ms));
        let active = s.devices[p].busy.kernels() > 0;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null in/out parameter.
        let cap = unsafe { *count };
        if !active {
            put!(count, 0);
            return Err(NVML_ERROR_NOT_FOUND);
        }
        put!(count, 1);
        if samples.is_null() || cap < 1 {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        put!(samples, nvmlProcessUtilizationSample_t { pid: s.nvml_pid(), timeStamp: now, smUtil: sm, memUtil: 0, encUtil: 0, decUtil: 0 });
        Ok(())
    }
    nvmlDeviceGetComputeRunningProcesses(d: nvmlDevice_t, count: *mut c_uint, infos: *mut ProcessInfoV1) |s| {
        processes(s, d, count, infos, |pid, used| ProcessInfoV1 { pid, used_gpu_memory: used })
    }
    nvmlDeviceGetComputeRunningProcesses_v2(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) |s| {
        processes(s, d, count, infos, |pid, used| nvmlProcessInfo_t { pid, usedGpuMemory: used, gpuInstanceId: u32::MAX, computeInstanceId: u32::MAX })
    }
    nvmlDeviceGetComputeRunningProcesses_v3(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) |s| {
        processes(s, d, count, infos, |pid, used| nvmlProcessInfo_t { pid, usedGpuMemory: used, gpuInstanceId: u32::MAX, computeInstanceId: u32::MAX })
    }
    nvmlDeviceGetGraphicsRunningProcesses_v3(d: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_t) |s| {
        dev_index(s, d)?;
        put!(count, 0);
        Ok(())
    }
}
