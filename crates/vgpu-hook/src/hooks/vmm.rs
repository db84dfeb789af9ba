//! Virtual memory management.

use super::*;

pub(crate) unsafe fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    let real_call = || call!(cuda, h.cuMemCreate(handle, size, prop, flags));
    // SAFETY: `prop` is null or a valid CUmemAllocationProp (driver contract).
    let Some(p) = (unsafe { read_in(prop) }) else {
        return real_call();
    };
    if p.location.type_ != CUmemLocationType::DEVICE || handle.is_null() || size == 0 {
        return real_call(); // host memory is not device memory; errors are the driver's
    }
    // On the handle's own device, which need not be the current one.
    let Some(idx) = dev_index(CUdevice(p.location.id)) else {
        return real_call();
    };
    let gran = driver::granularity(cuda, &p).unwrap_or(1).max(1);
    let Some(charge) = (size as u64).div_ceil(gran).checked_mul(gran) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            AllocationKind::VmmHandle,
            idx,
            NO_CONTEXT,
            size as u64,
            charge
        ))
        .map_err(alloc_err)
    );
    let r = real_call();
    if r.is_success() {
        // SAFETY: the driver filled the non-null out-pointer.
        if let Err(e) = pending.commit(unsafe { *handle }.0) {
            commit_err(e, "a cuMemCreate handle");
        }
        reconcile_if_due(st, cuda, idx);
    }
    r
}

pub(crate) unsafe fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemRelease(handle));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        let mut refs = st.vmm_extra_refs.lock().unwrap_or_else(|e| e.into_inner());
        match refs.get_mut(&handle.0) {
            // A reference from cuMemRetainAllocationHandle: the allocation lives on.
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                refs.remove(&handle.0);
            }
            None => {
                drop(refs);
                let _ = st.alloc.release_record(AllocationKind::VmmHandle, handle.0);
            }
        }
    }
    r
}

pub(crate) unsafe fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemRetainAllocationHandle(handle, addr));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        // SAFETY: the driver filled the out-pointer (it fails on null).
        if let Some(h) = unsafe { read_back(handle) } {
            // The same handle value as cuMemCreate returned, one reference more.
            if st.alloc.lookup(AllocationKind::VmmHandle, h.0).is_some() {
                *st.vmm_extra_refs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(h.0)
                    .or_insert(0) += 1;
            }
        }
    }
    r
}
