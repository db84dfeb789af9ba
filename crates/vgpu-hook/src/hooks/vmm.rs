//! Virtual memory management: a handle is charged at creation on its own device and
//! released with its last reference.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

pub(crate) unsafe fn cuMemCreate(
    forward: impl Forward,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: u64,
) -> Result<(), CUresult> {
    let st = ready()?;
    let cuda = real::cuda()?;
    // SAFETY: `prop` is null or a valid CUmemAllocationProp (driver contract).
    let Some(p) = (unsafe { read_in(prop) }) else {
        return forward(cuda);
    };
    if p.location.type_ != CUmemLocationType::DEVICE || handle.is_null() || size == 0 {
        return forward(cuda); // host memory is not device memory; errors are the driver's
    }
    // On the handle's own device, which need not be the current one.
    let Some(idx) = dev_index(CUdevice(p.location.id)) else {
        return forward(cuda);
    };
    let gran = driver::granularity(cuda, &p).unwrap_or(1).max(1);
    let charge = (size as u64)
        .div_ceil(gran)
        .checked_mul(gran)
        .ok_or(CUresult::OUT_OF_MEMORY)?;
    let charge = Charge {
        kind: AllocationKind::VmmHandle,
        device: idx,
        context: NO_CONTEXT,
        requested: size as u64,
        charge,
        what: "a cuMemCreate handle",
    };
    // SAFETY: non-null out-pointer (checked above).
    let host = |e| unsafe { host_handle_or(st, cuda, idx, handle, size as u64, &p, e) };
    let Some(pending) = charge_then_forward(st, cuda, forward, &charge, host)? else {
        return Ok(());
    };
    // SAFETY: the driver filled the non-null out-pointer.
    commit(pending, unsafe { *handle }.0, charge.what);
    reconcile_if_due(st, cuda, idx);
    Ok(())
}

/// A device-located `cuMemCreate` the device could not take, made in host memory if it may be
/// ([`host_backed_instead`]): the program maps and accesses it as it would the device handle.
///
/// # Safety
/// `handle` is the caller's non-null out-pointer.
#[cold]
#[inline(never)]
unsafe fn host_handle_or(
    st: &Ready,
    cuda: &Cuda,
    idx: DeviceIndex,
    handle: *mut CUmemGenericAllocationHandle,
    size: u64,
    prop: &CUmemAllocationProp,
    refused: AllocError,
) -> Result<(), CUresult> {
    let h = host_backed_instead(st, refused, || {
        st.host_backed
            .create_handle(cuda, st.ledger(), idx, size, prop)
    })?;
    // SAFETY: non-null out-pointer (the caller's contract).
    unsafe { write_out(handle, h) }
}

/// `cuMemRelease` succeeded: one reference fewer; the last one releases the charge.
pub(crate) fn vmm_released(
    _cuda: &Cuda,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    if st.host_backed.handle_released(st.ledger(), handle) {
        return Ok(());
    }
    let mut refs = locked(&st.vmm_extra_refs);
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
    Ok(())
}

/// `cuMemRetainAllocationHandle` succeeded: one reference more on a handle we charged.
///
/// # Safety
/// `handle` is the out-pointer the driver just filled.
pub(crate) unsafe fn vmm_retained(
    _cuda: &Cuda,
    handle: *mut CUmemGenericAllocationHandle,
) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    // SAFETY: the driver filled the out-pointer (it fails on null).
    if let Some(h) = unsafe { read_back(handle) } {
        // The same handle value as cuMemCreate returned, one reference more.
        if st.alloc.lookup(AllocationKind::VmmHandle, h.0).is_some() {
            *locked(&st.vmm_extra_refs).entry(h.0).or_insert(0) += 1;
        }
    }
    Ok(())
}
