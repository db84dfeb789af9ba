//! Contexts: measured as the growth of the device's used memory (NVML, which needs no
//! context) across the creation. Just before it, the SM limiter records the device's power
//! (`sm_limit::context_creating`: once per device, with an SM limit only).

use super::*;

/// What NVML says around a context creation: this process's used memory on the device and
/// the device's used memory.
#[derive(Debug, Clone, Copy)]
pub(super) struct UsedSample {
    process: ProcessUsage,
    device: Option<u64>,
}

pub(super) fn sample_used(st: &Ready, cuda: &Cuda, dev: CUdevice) -> UsedSample {
    UsedSample {
        process: process_used(st, cuda, dev),
        device: driver::nvml_used_bytes(cuda, dev),
    }
}

/// The memory a context creation took: the growth of this process's own used memory when
/// NVML lists the process afterwards (before, a process without a context is not listed:
/// 0), so another process allocating meanwhile does not inflate it; else the growth of the
/// device's used memory. `None` when neither was measured.
pub(super) fn context_growth(before: UsedSample, after: UsedSample) -> Option<u64> {
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

/// Charges `bytes` of context memory for `ctx`; on refusal `undo` destroys the context.
pub(super) fn charge_context(
    st: &Ready,
    idx: DeviceIndex,
    ctx: CUcontext,
    bytes: u64,
    undo: impl FnOnce(),
) -> CUresult {
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
            if let Err(e) = p.commit(ctx as u64) {
                commit_err(e, "a context");
            }
            st.residual.context_created(ctx as usize, idx);
            CUresult::SUCCESS
        }
        Err(e) => {
            undo();
            alloc_err(e)
        }
    }
}

pub(crate) unsafe fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    let real_call = || call!(cuda, h.cuDevicePrimaryCtxRetain(pctx, dev));
    let (Some(st), Some(idx)) = (ready_state(), dev_index(dev)) else {
        return real_call();
    };
    let creating = !driver::primary_ctx_active(cuda, dev).unwrap_or(true);
    let before = creating.then(|| sample_used(st, cuda, dev));
    if creating {
        sm_limit::context_creating(idx.0 as usize);
    }
    let r = real_call();
    if !r.is_success() || pctx.is_null() {
        return r;
    }
    if !creating {
        return r;
    }
    // SAFETY: the driver filled the non-null out-pointer.
    let ctx = unsafe { *pctx };
    // Measured before taking our lock (NVML calls may enter the loader).
    let after = before.map(|_| sample_used(st, cuda, dev));
    let mut primary = st.primary.lock().unwrap_or_else(|e| e.into_inner());
    if primary.contains_key(&dev.0) {
        return r; // another thread created and charged it
    }
    let Some(bytes) = before.zip(after).and_then(|(b, a)| context_growth(b, a)) else {
        vlog!(
            INFO,
            "device {idx}: context memory not measured (NVML unavailable)"
        );
        return r;
    };
    let code = charge_context(st, idx, ctx, bytes, || {
        let _ = call!(cuda, h.cuDevicePrimaryCtxRelease_v2(dev));
    });
    if code.is_success() {
        primary.insert(dev.0, ctx as usize);
        drop(primary);
        // Anything else the driver took for this process meanwhile.
        st.residual.ran_now();
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
    }
    code
}

/// After a primary context release or reset: if it is gone, so is everything in it.
pub(super) fn primary_gone(cuda: &Cuda, dev: CUdevice, r: CUresult) -> CUresult {
    let Some(st) = ready_state().filter(|_| r.is_success()) else {
        return r;
    };
    if driver::primary_ctx_active(cuda, dev).unwrap_or(true) {
        return r;
    }
    driver::contexts_changed();
    let ctx = st
        .primary
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&dev.0);
    if let Some(ctx) = ctx {
        st.residual.context_gone(ctx);
        let released = st.alloc.release_context(ContextId(ctx as u64));
        vlog!(
            DEBUG,
            "device {}: primary context gone, released {} bytes",
            dev.0,
            released.released
        );
    }
    // Its code went with it.
    after_code_unload(r)
}

pub(crate) unsafe fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_gone(cuda, dev, call!(cuda, h.cuDevicePrimaryCtxRelease(dev)))
}

pub(crate) unsafe fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_gone(cuda, dev, call!(cuda, h.cuDevicePrimaryCtxRelease_v2(dev)))
}

/// Reset destroys every allocation of the primary context (it stays retained).
pub(super) fn primary_reset(dev: CUdevice, r: CUresult) -> CUresult {
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        driver::contexts_changed();
        let ctx = st
            .primary
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&dev.0);
        if let Some(ctx) = ctx {
            st.residual.context_gone(ctx);
            st.alloc.release_context(ContextId(ctx as u64));
        }
    }
    after_code_unload(r)
}

pub(crate) unsafe fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_reset(dev, call!(cuda, h.cuDevicePrimaryCtxReset(dev)))
}

pub(crate) unsafe fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    primary_reset(dev, call!(cuda, h.cuDevicePrimaryCtxReset_v2(dev)))
}

/// `cuCtxCreate*`: measure, create, charge.
pub(super) fn create_context(
    cuda: &Cuda,
    pctx: *mut CUcontext,
    dev: CUdevice,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let (Some(st), Some(idx)) = (ready_state(), dev_index(dev)) else {
        return real();
    };
    let before = sample_used(st, cuda, dev);
    sm_limit::context_creating(idx.0 as usize);
    let r = real();
    if !r.is_success() || pctx.is_null() {
        return r;
    }
    // SAFETY: the driver filled the non-null out-pointer.
    let ctx = unsafe { *pctx };
    let Some(bytes) = context_growth(before, sample_used(st, cuda, dev)) else {
        vlog!(
            INFO,
            "device {idx}: context memory not measured (NVML unavailable)"
        );
        return r;
    };
    let code = charge_context(st, idx, ctx, bytes, || {
        let _ = call!(cuda, h.cuCtxDestroy_v2(ctx));
    });
    if code.is_success() {
        st.residual.ran_now();
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
    }
    code
}

pub(crate) unsafe fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let cuda = tri!(real::cuda());
    create_context(cuda, pctx, dev, || {
        call!(cuda, h.cuCtxCreate_v2(pctx, flags, dev))
    })
}

pub(crate) unsafe fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: CUexecAffinityParamPtr,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let cuda = tri!(real::cuda());
    create_context(cuda, pctx, dev, || {
        call!(cuda, h.cuCtxCreate_v3(pctx, params, num_params, flags, dev))
    })
}

pub(crate) unsafe fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: CUctxCreateParamsPtr,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let cuda = tri!(real::cuda());
    create_context(cuda, pctx, dev, || {
        call!(cuda, h.cuCtxCreate_v4(pctx, params, flags, dev))
    })
}

pub(super) fn context_destroyed(ctx: CUcontext, r: CUresult) -> CUresult {
    if r.is_success() {
        driver::contexts_changed();
    }
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        st.residual.context_gone(ctx as usize);
        st.alloc.release_context(ctx_id(ctx));
    }
    after_code_unload(r)
}

pub(crate) unsafe fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    let cuda = tri!(real::cuda());
    context_destroyed(ctx, call!(cuda, h.cuCtxDestroy(ctx)))
}

pub(crate) unsafe fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let cuda = tri!(real::cuda());
    context_destroyed(ctx, call!(cuda, h.cuCtxDestroy_v2(ctx)))
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
