//! Views: what the driver and NVML report, rewritten to the limit.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// `cuMemGetInfo_v2` succeeded: show the current device's memory under the limit.
///
/// # Safety
/// `free` and `total` are the out-pointers the driver just filled.
pub(crate) unsafe fn mem_info_view(
    cuda: &Cuda,
    free: *mut usize,
    total: *mut usize,
) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    let Some(idx) = driver::current_device(cuda).ok().and_then(dev_index) else {
        return Ok(());
    };
    reconcile_if_due(st, cuda, idx);
    // SAFETY: the driver just filled both (it fails on null).
    let (Some(f), Some(t)) = (unsafe { read_back(free) }, unsafe { read_back(total) }) else {
        return Ok(());
    };
    let (f, t) = view_of(st, idx, f as u64, t as u64);
    // SAFETY: valid out-pointers (checked non-null above).
    unsafe {
        *free = f as usize;
        *total = t as usize;
    }
    Ok(())
}

/// The `(free, total)` a view shows on device `idx`. With `CUDA_OVERSUBSCRIBE` under a limit
/// the container's device is as large as its limit whatever the GPU has free, since host
/// memory backs what the GPU cannot hold (docs/oversubscription.md).
fn view_of(st: &Ready, idx: DeviceIndex, phys_free: u64, phys_total: u64) -> (u64, u64) {
    let usage = st.ledger().usage_for_view(idx);
    match (usage.limit, st.config.host_backing.oversubscribe) {
        (Some(limit), true) => {
            let host = st.ledger().host_used(idx);
            crate::host_backing::oversubscribed_view(limit, usage.used, host)
        }
        _ => virtual_mem_info(phys_free, phys_total, usage),
    }
}

/// `cuDeviceTotalMem_v2` succeeded: a limited device is as large as its limit.
///
/// # Safety
/// `bytes` is the out-pointer the driver just filled.
pub(crate) unsafe fn total_mem_view(
    _cuda: &Cuda,
    bytes: *mut usize,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let (Some(st), Some(idx)) = (ready_state(), dev_index(dev)) else {
        return Ok(());
    };
    // SAFETY: the driver filled it (it fails on null).
    let filled = unsafe { read_back(bytes) };
    if let (Some(limit), Some(t)) = (st.ledger().usage(idx).limit, filled) {
        // Oversubscribed, the device is as large as the limit (as `cuMemGetInfo` says).
        let shown = if st.config.host_backing.oversubscribe {
            limit
        } else {
            (t as u64).min(limit)
        };
        // SAFETY: valid out-pointer (read back above).
        unsafe { *bytes = shown as usize };
    }
    Ok(())
}

/// The shared file's index and usage of the GPU an NVML handle names, found by UUID among the shared file's GPUs
/// (none for a GPU that is not the container's). Asks NVML only: an NVML-only process must
/// not initialize CUDA (a child it forks could not use it). Reconciles first when this
/// process has a CUDA device on that GPU.
pub(super) fn nvml_device_usage(
    st: &Ready,
    nvml: &real::Nvml,
    device: nvmlDevice_t,
) -> Option<(DeviceIndex, vgpu_alloc_core::DeviceUsage)> {
    let ledger = st.ledger();
    let file_device = ledger.device_of_uuid(&driver::nvml_uuid(nvml, device)?)?;
    if let Some(ordinal) = ledger.ordinal_of(file_device)
        && let Ok(cuda) = real::cuda()
    {
        reconcile_if_due(st, cuda, ordinal);
    }
    Some((file_device, ledger.file_usage_for_view(file_device)))
}

/// One of NVML's memory-info structs, rewritten to the limit's view.
pub(crate) trait NvmlMemoryView: Copy {
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

/// Either `nvmlDeviceGetMemoryInfo` version succeeded: show the limit's view.
///
/// # Safety
/// `memory` is the out-pointer NVML just filled.
pub(crate) unsafe fn nvml_memory_view<T: NvmlMemoryView>(
    nvml: &real::Nvml,
    device: nvmlDevice_t,
    memory: *mut T,
) -> Result<(), nvmlReturn_t> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    // SAFETY: NVML filled it (it fails on null).
    let Some(mut m) = (unsafe { read_back(memory) }) else {
        return Ok(());
    };
    let (total, free) = m.driver_view();
    let view = nvml_device_usage(st, nvml, device).and_then(|(file_device, u)| {
        match (u.limit, st.config.host_backing.oversubscribe) {
            // Device and host-backed memory against the limit (as `view_of`).
            (Some(limit), true) => {
                let host = st.ledger().file_host_used(file_device);
                let (f, t) = crate::host_backing::oversubscribed_view(limit, u.used, host);
                Some((t, f, t - f))
            }
            _ => virtual_nvml_info(total, free, u),
        }
    });
    if let Some((total, free, used)) = view {
        m.set_virtual(total, free, used);
        // SAFETY: valid out-pointer.
        unsafe { *memory = m };
    }
    Ok(())
}
