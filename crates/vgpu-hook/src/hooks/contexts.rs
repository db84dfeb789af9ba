//! Contexts: measured as the growth of the device's used memory (NVML, which needs no
//! context) across the creation.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// What NVML says around a context creation: this process's used memory on the device and
/// the device's used memory.
#[derive(Debug, Clone, Copy)]
struct UsedSample {
    process: ProcessUsage,
    device: Option<u64>,
}

fn sample_used(st: &Ready, cuda: &Cuda, dev: CUdevice) -> UsedSample {
    UsedSample {
        process: process_used(st, cuda, dev),
        device: driver::nvml_used_bytes(cuda, dev),
    }
}

/// The memory a context creation took: the growth of this process's own used memory when
/// NVML lists the process afterwards (before, a process without a context is not listed:
/// 0), so another process allocating meanwhile does not inflate it; else the growth of the
/// device's used memory. `None` when neither was measured.
fn context_growth(before: UsedSample, after: UsedSample) -> Option<u64> {
    let before_process = match before.process {
        ProcessUsage::Used(u) => Some(u),
        ProcessUsage::NotListed { .. } => Some(0),
        ProcessUsage::Unavailable => None,
    };
    match (before_process, after.process) {
        (Some(b), ProcessUsage::Used(a)) => Some(measured_growth(b, a)),
        _ => before
            .device
            .zip(after.device)
            .map(|(b, a)| measured_growth(b, a)),
    }
}

/// Charges the context memory measured for `ctx` (`None`: not measured, nothing charged:
/// `Ok(false)`); on refusal `undo` destroys the context.
fn charge_context(
    st: &Ready,
    idx: DeviceIndex,
    ctx: CUcontext,
    bytes: Option<u64>,
    undo: impl FnOnce(),
) -> Result<bool, CUresult> {
    let Some(bytes) = bytes else {
        vlog!(
            INFO,
            "device {idx}: context memory not measured (NVML unavailable)"
        );
        return Ok(false);
    };
    vlog!(
        INFO,
        "device {idx}: context {:#x} takes {bytes} bytes",
        ctx as usize
    );
    match st
        .alloc
        .begin_record(AllocationKind::Context, idx, ctx_id(ctx), bytes, bytes)
    {
        Ok(p) => {
            commit(p, ctx as u64, "a context");
            st.residual.context_created(ctx as usize, idx);
            Ok(true)
        }
        Err(e) => {
            undo();
            Err(alloc_err(e))
        }
    }
}

/// Creates a context on `dev` with `forward`, measuring what it took on the device (NVML,
/// before and after): the device's index, the new context and its bytes (`None`: not
/// measured); or `None`, nothing to charge, for a device past the limits' range (only
/// forwarded) or when the caller asked for no handle.
///
/// # Safety
/// `pctx` as the driver API's contract requires.
unsafe fn create_measured(
    st: &Ready,
    cuda: &Cuda,
    dev: CUdevice,
    forward: impl Forward,
    pctx: *mut CUcontext,
) -> Result<Option<(DeviceIndex, CUcontext, Option<u64>)>, CUresult> {
    let Some(idx) = dev_index(dev) else {
        forward(cuda)?;
        return Ok(None);
    };
    let before = sample_used(st, cuda, dev);
    forward(cuda)?;
    if pctx.is_null() {
        return Ok(None);
    }
    // SAFETY: the driver filled the non-null out-pointer.
    let ctx = unsafe { *pctx };
    // Measured before the caller takes any lock of ours (NVML calls may enter the loader).
    Ok(Some((
        idx,
        ctx,
        context_growth(before, sample_used(st, cuda, dev)),
    )))
}

/// After a context was charged on `idx`: anything else the driver took for this process
/// meanwhile.
fn settle_after_context(st: &Ready, cuda: &Cuda, idx: DeviceIndex) {
    st.residual.ran_now();
    let _ = reconcile(st, cuda, idx, OverLimit::Charge);
}

pub(crate) unsafe fn cuDevicePrimaryCtxRetain(
    forward: impl Forward,
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer, as the driver API's contract requires.
    unsafe { retain_primary(forward, pctx, dev) }?;
    if let (Some(st), false) = (ready_state(), pctx.is_null()) {
        // SAFETY: the driver filled the non-null out-pointer.
        let ctx = unsafe { *pctx };
        st.host_backed.contexts.primary_retained(ctx as usize, dev);
    }
    Ok(())
}

/// The primary context of `dev` retained, created and charged if it was not active.
///
/// # Safety
/// `pctx` as the driver API's contract requires.
unsafe fn retain_primary(
    forward: impl Forward,
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    if driver::primary_ctx_active(cuda, dev).unwrap_or(true) {
        return forward(cuda); // retaining an existing context takes nothing
    }
    // A new context takes device memory: refused while enforcement is off.
    let st = ready()?;
    // SAFETY: the caller's out-pointer, as the driver API's contract requires.
    let Some((idx, ctx, bytes)) = (unsafe { create_measured(st, cuda, dev, forward, pctx) })?
    else {
        return Ok(());
    };
    let mut primary = locked(&st.primary);
    if primary.contains_key(&dev.0) {
        return Ok(()); // another thread created and charged it
    }
    let charged = charge_context(st, idx, ctx, bytes, || {
        let _ = driver::primary_ctx_release(cuda, dev);
    })?;
    if !charged {
        return Ok(());
    }
    let bytes = bytes.unwrap_or(0);
    primary.insert(
        dev.0,
        state::PrimaryCharge {
            ctx: ctx as usize,
            bytes,
        },
    );
    drop(primary);
    settle_after_context(st, cuda, idx);
    Ok(())
}

/// The primary context of `dev` is gone: forget it and release everything charged in it
/// (the bytes released; `None` when none was charged).
fn forget_primary(st: &Ready, dev: CUdevice) -> Option<u64> {
    driver::contexts_changed();
    let ctx = locked(&st.primary).remove(&dev.0)?;
    st.residual.context_gone(ctx.ctx);
    host_backed_context_gone(st, ctx.ctx);
    Some(st.alloc.release_context(ContextId(ctx.ctx as u64)).released)
}

/// Host-backed allocations of a destroyed context go with it (`crate::host_backing`).
fn host_backed_context_gone(st: &Ready, ctx: usize) {
    if let (true, Ok(cuda)) = (st.host_backed.any(), real::cuda()) {
        st.host_backed.context_gone(cuda, st.ledger(), ctx);
    }
}

/// `cuDevicePrimaryCtxRelease[_v2]` succeeded: if the context is gone, so is everything in
/// it.
pub(crate) fn primary_released(cuda: &Cuda, dev: CUdevice) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    if driver::primary_ctx_active(cuda, dev).unwrap_or(true) {
        return Ok(());
    }
    st.host_backed.contexts.primary_gone(dev);
    if let Some(released) = forget_primary(st, dev) {
        vlog!(
            DEBUG,
            "device {}: primary context gone, released {released} bytes",
            dev.0
        );
    }
    // Its code went with it.
    code_unloaded(cuda)
}

/// `cuDevicePrimaryCtxReset[_v2]` succeeded: every allocation of the primary context is
/// destroyed. A driver that keeps the context itself alive through the reset (it stays
/// retained and active, as the simulator's does) keeps its memory: that is charged again,
/// since the next retain finds the context active and measures nothing (issue 12: a
/// process held 2,112 MiB under 2 GiB). When the reset destroyed it, the next retain
/// creates and measures a new one.
pub(crate) fn primary_reset(cuda: &Cuda, dev: CUdevice) -> Result<(), CUresult> {
    if let Some(st) = ready_state() {
        let charged = locked(&st.primary).get(&dev.0).copied();
        forget_primary(st, dev);
        let kept = driver::primary_ctx_active(cuda, dev).unwrap_or(false);
        if !kept {
            st.host_backed.contexts.primary_gone(dev);
        }
        if let (Some(c), Some(idx), true) = (charged, dev_index(dev), kept) {
            let ctx = c.ctx as CUcontext;
            let mut primary = locked(&st.primary);
            match charge_context(st, idx, ctx, Some(c.bytes), || {}) {
                Ok(_) => {
                    primary.insert(dev.0, c);
                }
                Err(_) => vlog!(
                    WARN,
                    "device {idx}: the primary context kept through a reset ({} bytes) no longer \
                     fits the limit; it is not charged until it is recreated",
                    c.bytes
                ),
            }
        }
    }
    code_unloaded(cuda)
}

/// Every `cuCtxCreate` version: measure, create, charge.
///
/// # Safety
/// `pctx` as the driver API's contract requires.
pub(crate) unsafe fn create_context(
    forward: impl Forward,
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    // It takes device memory: refused while enforcement is off.
    let st = ready()?;
    // SAFETY: the caller's out-pointer, as the driver API's contract requires.
    let Some((idx, ctx, bytes)) = (unsafe { create_measured(st, cuda, dev, forward, pctx) })?
    else {
        if !pctx.is_null() {
            // SAFETY: the driver filled the non-null out-pointer (the creation succeeded).
            st.host_backed
                .contexts
                .created(unsafe { *pctx } as usize, dev);
        }
        return Ok(());
    };
    let charged = charge_context(st, idx, ctx, bytes, || {
        let _ = driver::ctx_destroy(cuda, ctx);
    })?;
    st.host_backed.contexts.created(ctx as usize, dev);
    if charged {
        settle_after_context(st, cuda, idx);
    }
    Ok(())
}

/// `cuCtxDestroy[_v2]` succeeded: everything in the context is gone.
pub(crate) fn context_destroyed(cuda: &Cuda, ctx: CUcontext) -> Result<(), CUresult> {
    driver::contexts_changed();
    if let Some(st) = ready_state() {
        st.host_backed.contexts.destroyed(ctx as usize);
        st.residual.context_gone(ctx as usize);
        host_backed_context_gone(st, ctx as usize);
        st.alloc.release_context(ctx_id(ctx));
    }
    code_unloaded(cuda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_is_measured_by_the_process_own_growth_when_nvml_lists_it() {
        let sample = |process, device| UsedSample { process, device };
        const M: u64 = 1 << 20;
        // Not listed before (no context yet), listed after: per-process growth, even though
        // another process took 1 GiB of the device meanwhile.
        let b = sample(ProcessUsage::NotListed { listed: 3 }, Some(10 * M));
        let a = sample(ProcessUsage::Used(500 * M), Some(1534 * M));
        assert_eq!(context_growth(b, a), Some(500 * M));
        // A second context: growth of the process's figure.
        let b = sample(ProcessUsage::Used(500 * M), Some(1534 * M));
        let a = sample(ProcessUsage::Used(800 * M), Some(1834 * M));
        assert_eq!(context_growth(b, a), Some(300 * M));
        // Not listed after (a PID namespace NVML does not see): the device's growth.
        let b = sample(ProcessUsage::NotListed { listed: 0 }, Some(10 * M));
        let a = sample(ProcessUsage::NotListed { listed: 1 }, Some(510 * M));
        assert_eq!(context_growth(b, a), Some(500 * M));
        // Nothing measurable.
        let none = sample(ProcessUsage::Unavailable, None);
        assert_eq!(context_growth(none, none), None);
    }
}
