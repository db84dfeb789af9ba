//! Driver-internal memory: reconciled with NVML's per-process used memory (`crate::residual`).

use super::*;

/// NVML's used memory of this process on `dev` (its NVML handle cached per ordinal).
pub(super) fn process_used(st: &Ready, cuda: &Cuda, dev: CUdevice) -> ProcessUsage {
    let cached = locked(&st.nvml_handles).get(&dev.0).copied();
    let handle = match cached {
        Some(h) => h as nvmlDevice_t,
        None => {
            // Looked up without holding our lock: NVML may enter the loader.
            let Some(h) = driver::nvml_device(cuda, dev) else {
                return ProcessUsage::Unavailable;
            };
            locked(&st.nvml_handles).insert(dev.0, h as usize);
            h
        }
    };
    driver::nvml_process_used(handle, st.ledger().nvml_pid())
}

/// Brings this process's module charge on `idx` to the residual: NVML's used memory of the
/// process minus everything else vgpu charges for it there. `OverLimit::Refuse` reports a
/// growth the limit refuses instead of charging it.
pub(super) fn reconcile(
    st: &Ready,
    cuda: &Cuda,
    idx: DeviceIndex,
    mode: OverLimit,
) -> Result<(), OutOfMemory> {
    let ledger = st.ledger();
    if !st.residual.enabled() || !st.residual.tracks(idx) {
        return Ok(()); // off, or no context of ours on this device
    }
    let used = match process_used(st, cuda, CUdevice(idx.0 as i32)) {
        ProcessUsage::Used(u) => u,
        ProcessUsage::Unavailable => return Ok(()),
        ProcessUsage::NotListed { listed } => {
            if !st.residual.has_context(idx) {
                // The last context was destroyed: so is the driver's memory for this process.
                let _ = st
                    .residual
                    .settle(ledger, idx, 0, || ledger.held_by_self(idx), mode);
            } else if st.residual.first_not_listed() {
                let pid = ledger.nvml_pid();
                vlog!(
                    WARN,
                    "device {idx}: NVML does not list this process (pid {pid}) among the {listed} \
                     processes using the GPU, so memory the driver takes for it outside vgpu's view \
                     (lazily loaded code, driver heaps) is not charged while this lasts. NVML lists \
                     host pids: in a container with its own PID namespace the monitor must write the \
                     host pid into the shared file (hostpid). Said once."
                );
            }
            return Ok(());
        }
    };
    let settled = st
        .residual
        .settle(ledger, idx, used, || ledger.held_by_self(idx), mode)?;
    if let Some(oom) = settled.over_limit {
        if st.residual.first_over_limit() {
            vlog!(
                WARN,
                "device {idx}: the driver holds {} bytes for this process outside vgpu's view \
                 (module code, driver heaps); they are charged as module memory although usage is \
                 now {} bytes, over the limit of {} bytes: the memory is already taken. Further \
                 allocations are refused until usage drops. Said once.",
                settled.charged,
                oom.in_use.saturating_add(oom.requested),
                oom.limit
            );
        }
    }
    vlog!(
        DEBUG,
        "device {idx}: NVML says this process uses {used} bytes; driver-internal residual {} bytes",
        settled.charged
    );
    Ok(())
}

/// [`reconcile`] on every device where this process holds memory.
pub(super) fn reconcile_all(st: &Ready, cuda: &Cuda, mode: OverLimit) -> Result<(), OutOfMemory> {
    st.residual.ran_now();
    for d in 0..MAX_DEVICES as u32 {
        let idx = DeviceIndex(d);
        if st.residual.tracks(idx) {
            reconcile(st, cuda, idx, mode)?;
        }
    }
    Ok(())
}

/// Rate-limited [`reconcile`] for paths that may pay for it now and then (views,
/// driver-reaching allocations): one clock read when not due.
pub(super) fn reconcile_if_due(st: &Ready, cuda: &Cuda, idx: DeviceIndex) {
    if st.residual.due() {
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
    }
}
