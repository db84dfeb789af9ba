//! Views: what the driver and NVML report, rewritten to the limit.

use super::*;

pub(crate) unsafe fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemGetInfo_v2(free, total));
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    let Some(idx) = driver::current_device(cuda).ok().and_then(dev_index) else {
        return r;
    };
    reconcile_if_due(st, cuda, idx);
    // SAFETY: the driver just filled both (it fails on null).
    let (Some(f), Some(t)) = (unsafe { read_back(free) }, unsafe { read_back(total) }) else {
        return r;
    };
    let (f, t) = virtual_mem_info(f as u64, t as u64, st.ledger().usage_for_view(idx));
    // SAFETY: valid out-pointers (checked non-null above).
    unsafe {
        *free = f as usize;
        *total = t as usize;
    }
    r
}

pub(crate) unsafe fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuDeviceTotalMem_v2(bytes, dev));
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    let Some(idx) = dev_index(dev) else { return r };
    // SAFETY: the driver filled it (it fails on null).
    let filled = unsafe { read_back(bytes) };
    if let (Some(limit), Some(t)) = (st.ledger().usage(idx).limit, filled) {
        // SAFETY: valid out-pointer (read back above).
        unsafe { *bytes = (t as u64).min(limit) as usize };
    }
    r
}

/// The usage of the CUDA device an NVML handle names (by UUID), if it is visible to this
/// process.
pub(super) fn nvml_device_usage(
    st: &Ready,
    nvml: &real::Nvml,
    device: nvmlDevice_t,
) -> Option<vgpu_alloc_core::DeviceUsage> {
    let uuid = driver::nvml_uuid(nvml, device)?;
    let cached = |map: &HashMap<String, i32>| map.get(&uuid).copied();
    let known = st
        .ordinals_by_uuid
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(cached);
    let ordinal = match known {
        Some(ordinal) => ordinal?,
        None => {
            // Built without holding our lock: loading the driver may wait on the loader.
            let map = driver::cuda_ordinals_by_uuid(real::cuda().ok()?);
            let ordinal = cached(&map);
            *st.ordinals_by_uuid
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(map);
            ordinal?
        }
    };
    let idx = dev_index(CUdevice(ordinal))?;
    if let Ok(cuda) = real::cuda() {
        reconcile_if_due(st, cuda, idx);
    }
    Some(st.ledger().usage_for_view(idx))
}

/// One of NVML's memory-info structs, rewritten to the limit's view.
pub(super) trait NvmlMemoryView: Copy {
    /// `(total, free)` as the driver reported them.
    fn driver_view(&self) -> (u64, u64);
    /// Replace the figures with the virtual `(total, free, used)`.
    fn set_virtual(&mut self, total: u64, free: u64, used: u64);
}

impl NvmlMemoryView for nvmlMemory_t {
    fn driver_view(&self) -> (u64, u64) {
        (self.total, self.free)
    }
    fn set_virtual(&mut self, total: u64, free: u64, used: u64) {
        (self.total, self.free, self.used) = (total, free, used);
    }
}

impl NvmlMemoryView for nvmlMemory_v2_t {
    fn driver_view(&self) -> (u64, u64) {
        (self.total, self.free)
    }
    fn set_virtual(&mut self, total: u64, free: u64, used: u64) {
        (self.total, self.free, self.used) = (total, free, used);
        self.reserved = 0; // total = free + used under the limit
    }
}

pub(super) type NvmlMemoryFn<T> = unsafe extern "C" fn(nvmlDevice_t, *mut T) -> nvmlReturn_t;

/// Both `nvmlDeviceGetMemoryInfo` versions: forward, then show the limit's view.
///
/// # Safety
/// `memory` as NVML's contract requires (NVML itself rejects null).
pub(super) unsafe fn nvml_memory_info<T: NvmlMemoryView>(
    device: nvmlDevice_t,
    memory: *mut T,
    real_fn: impl FnOnce(&real::Nvml) -> Option<NvmlMemoryFn<T>>,
) -> nvmlReturn_t {
    let nvml = match real::nvml() {
        Ok(n) => n,
        Err(e) => return e,
    };
    let Some(f) = real_fn(nvml) else {
        return nvmlReturn_t::FUNCTION_NOT_FOUND;
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(device, memory) };
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    // SAFETY: NVML filled it (it fails on null).
    let Some(mut m) = (unsafe { read_back(memory) }) else {
        return r;
    };
    let (total, free) = m.driver_view();
    if let Some((total, free, used)) =
        nvml_device_usage(st, nvml, device).and_then(|u| virtual_nvml_info(total, free, u))
    {
        m.set_virtual(total, free, used);
        // SAFETY: valid out-pointer.
        unsafe { *memory = m };
    }
    r
}

pub(crate) unsafe fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    // SAFETY: the caller's pointer, as NVML's contract requires.
    unsafe { nvml_memory_info(device, memory, |n| n.h.nvmlDeviceGetMemoryInfo) }
}

pub(crate) unsafe fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    // SAFETY: the caller's pointer, as NVML's contract requires.
    unsafe { nvml_memory_info(device, memory, |n| n.h.nvmlDeviceGetMemoryInfo_v2) }
}
