//! Plain device memory.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

pub(crate) unsafe fn cuMemAlloc_v2(
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
) -> Result<(), CUresult> {
    let st = ready()?;
    let cuda = real::cuda()?;
    if dptr.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let (ctx, dev) = driver::current(cuda)?;
    let Some(idx) = dev_index(dev) else {
        vlog!(
            WARN,
            "device {} is beyond the {MAX_DEVICES} tracked devices: not accounted",
            dev.0
        );
        return forward(cuda);
    };
    let bytes = bytesize as u64;
    if let Some(free) = reserve_breach(st, cuda, idx, bytes) {
        let ptr = keep_reserve(st, (idx, bytes), free, |full| {
            host_backed_or(st, cuda, idx, (dev, ctx), bytes, full)
        })?;
        // SAFETY: non-null out-pointer (checked above).
        return unsafe { write_out(dptr, ptr) };
    }
    // Swapping on and asked: large allocations are the hook's VMM memory, which can move
    // (docs/swap.md). Anything that fails here takes the usual path, which answers.
    if st.config.swap.makes_movable()
        && bytes >= DEVICE_PAGE
        && let Ok(ptr) = st
            .host_backed
            .allocate_movable(cuda, st.ledger(), idx, (dev, ctx), bytes)
    {
        // SAFETY: non-null out-pointer (checked above).
        return unsafe { write_out(dptr, ptr) };
    }
    let allocate = || {
        with_pool_retry(st, cuda, || {
            st.alloc.allocate(idx, ctx_id(ctx), bytesize as u64)
        })
    };
    let a = match allocate().or_else(|e| match e {
        // No room on the GPU: less urgent containers may swap out for it, once.
        AllocError::Backend(b)
            if CUresult(b.code) == CUresult::OUT_OF_MEMORY
                && crate::swap::room::made(st, cuda, dev, bytes) =>
        {
            allocate()
        }
        e => Err(e),
    }) {
        Ok(a) => a,
        Err(e) => {
            let ptr = host_backed_or(st, cuda, idx, (dev, ctx), bytesize as u64, e)?;
            // SAFETY: non-null out-pointer (checked above).
            return unsafe { write_out(dptr, ptr) };
        }
    };
    // Only allocations that reached the driver (no clock read on the sub-allocated path;
    // a sub-threshold request that fell back to the driver counts as direct).
    if a.kind == AllocationKind::Direct {
        reconcile_if_due(st, cuda, idx);
    }
    // SAFETY: non-null out-pointer (checked above).
    unsafe { write_out(dptr, CUdeviceptr(a.ptr.0)) }
}

/// Whether `ptr` lies inside one of the sub-allocator's regions (in a chunk that is not a
/// live allocation's base: a double free or an interior pointer). The driver must not see
/// it, or it would free the whole region under the other sub-allocations. One ordered
/// lookup, no copy of the region list.
fn inside_region(st: &Ready, ptr: CUdeviceptr) -> bool {
    st.alloc.region_containing(DevicePtr(ptr.0)).is_some()
}

/// The code for a failed free of `ptr` from our table.
pub(super) fn free_err(e: FreeError, ptr: CUdeviceptr) -> CUresult {
    match e {
        FreeError::NotTracked => CUresult::INVALID_VALUE,
        FreeError::Backend(b) => CUresult(b.code),
        FreeError::Internal(why) => {
            vlog!(
                ERROR,
                "internal accounting error freeing {:#x}: {why}",
                ptr.0
            );
            CUresult::UNKNOWN
        }
    }
}

/// A device allocation the device could not take (`refused`), in host memory if it may be
/// ([`host_backed_instead`]).
#[cold]
#[inline(never)]
fn host_backed_or(
    st: &Ready,
    cuda: &Cuda,
    idx: DeviceIndex,
    at: (CUdevice, CUcontext),
    bytes: u64,
    refused: AllocError,
) -> Result<CUdeviceptr, CUresult> {
    host_backed_instead(st, refused, || {
        st.host_backed.allocate(cuda, st.ledger(), idx, at, bytes)
    })
}

pub(crate) fn cuMemFree_v2(forward: impl Forward, dptr: CUdeviceptr) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let st = match state::get() {
        Enforcement::Ready(st) if dptr.0 != 0 => st,
        _ => return forward(cuda),
    };
    if st.host_backed.any() && st.host_backed.free(cuda, st.ledger(), dptr).is_some() {
        return Ok(());
    }
    match st.alloc.free(DevicePtr(dptr.0)) {
        Ok(_) => Ok(()),
        Err(FreeError::NotTracked) if inside_region(st, dptr) => {
            vlog!(
                WARN,
                "cuMemFree({:#x}): not a live allocation (double free or interior pointer)",
                dptr.0
            );
            Err(CUresult::INVALID_VALUE)
        }
        Err(FreeError::NotTracked) => {
            // Not ours to account (e.g. stream-ordered memory freed synchronously): the
            // driver frees it and answers as it would without vgpu.
            forward(cuda)?;
            if st.pools.is_active() {
                settle_all_pools(st, cuda);
            }
            Ok(())
        }
        Err(e) => Err(free_err(e, dptr)),
    }
}

pub(crate) unsafe fn cuMemAllocPitch_v2(
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width_in_bytes: usize,
    height: usize,
    _element_size_bytes: c_uint,
) -> Result<(), CUresult> {
    let st = ready()?;
    let cuda = real::cuda()?;
    if dptr.is_null() || pitch.is_null() || width_in_bytes == 0 || height == 0 {
        return forward(cuda); // the driver reports the invalid argument
    }
    let (ctx, dev) = driver::current(cuda)?;
    let Some(idx) = dev_index(dev) else {
        return forward(cuda);
    };
    let align = st.config.allocator.align;
    let aligned = |bytes: Option<u64>| bytes.and_then(|b| align_up(b, align));
    let requested = (width_in_bytes as u64).saturating_mul(height as u64);
    // Rows are padded to the pitch alignment (512 bytes on current GPUs); charge that
    // estimate up front and correct it with the real pitch.
    let estimate =
        aligned(align_up(width_in_bytes as u64, 512).and_then(|w| w.checked_mul(height as u64)))
            .ok_or(CUresult::OUT_OF_MEMORY)?;
    let charge = Charge {
        kind: AllocationKind::Pitched,
        device: idx,
        context: ctx_id(ctx),
        requested,
        charge: estimate,
        what: "a pitched allocation",
    };
    let at = (dev, ctx);
    // SAFETY: both out-pointers non-null (checked above).
    let host = |e| unsafe {
        pitched_host_backed(st, cuda, idx, at, dptr, pitch, width_in_bytes, height, e)
    };
    let Some(mut pending) = charge_then_forward(st, cuda, forward, &charge, host)? else {
        return Ok(());
    };
    // SAFETY: the driver filled both out-pointers (checked non-null above).
    let (ptr, real_pitch) = unsafe { (*dptr, *pitch) };
    let actual = aligned((real_pitch as u64).checked_mul(height as u64)).unwrap_or(u64::MAX);
    if let Err(e) = correct_charge(&mut pending, actual) {
        drop(pending);
        let _ = driver::mem_free(cuda, ptr);
        return Err(alloc_err(e));
    }
    commit(pending, ptr.0, charge.what);
    reconcile_if_due(st, cuda, idx);
    Ok(())
}

/// A pitched allocation the device could not take, host-backed like [`host_backed_or`]: rows
/// padded to 512 bytes (the pitch alignment of current GPUs).
///
/// # Safety
/// `dptr` and `pitch` are non-null caller out-pointers.
#[cold]
#[inline(never)]
unsafe fn pitched_host_backed(
    st: &Ready,
    cuda: &Cuda,
    idx: DeviceIndex,
    at: (CUdevice, CUcontext),
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    refused: AllocError,
) -> Result<(), CUresult> {
    let row = align_up(width as u64, 512).ok_or(CUresult::OUT_OF_MEMORY)?;
    let bytes = row
        .checked_mul(height as u64)
        .ok_or(CUresult::OUT_OF_MEMORY)?;
    let ptr = host_backed_or(st, cuda, idx, at, bytes, refused)?;
    // SAFETY: non-null out-pointers (the caller's contract).
    unsafe {
        write_out(pitch, row as usize)?;
        write_out(dptr, ptr)
    }
}

/// Change a pending charge to the size the driver really allocated, in place: the estimate
/// and the exact charge are never held together, so an allocation that fits the limit is
/// not refused because its estimate was still charged.
fn correct_charge<B: DeviceBackend, L: UsageLedger>(
    pending: &mut PendingRecord<'_, B, L>,
    actual: u64,
) -> Result<(), AllocError> {
    if pending.accounted() == actual {
        return Ok(());
    }
    pending.resize(actual)
}

pub(crate) unsafe fn cuMemAllocManaged(
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    _flags: c_uint,
) -> Result<(), CUresult> {
    let st = ready()?;
    let cuda = real::cuda()?;
    if !st.config.count_managed || dptr.is_null() || bytesize == 0 {
        return forward(cuda);
    }
    let (ctx, dev) = driver::current(cuda)?;
    let Some(idx) = dev_index(dev) else {
        return forward(cuda);
    };
    let charge =
        align_up(bytesize as u64, st.config.allocator.align).ok_or(CUresult::OUT_OF_MEMORY)?;
    let charge = Charge {
        kind: AllocationKind::Managed,
        device: idx,
        context: ctx_id(ctx),
        requested: bytesize as u64,
        charge,
        what: "a managed allocation",
    };
    // SAFETY: read after success: the driver filled the non-null out-pointer.
    charge_and_forward(st, cuda, forward, charge, || unsafe { *dptr }.0)?;
    reconcile_if_due(st, cuda, idx);
    Ok(())
}

/// The sub-allocation containing `ptr`, if `ptr` is inside one.
fn suballocation(ptr: CUdeviceptr) -> Option<vgpu_alloc_core::AddressRange> {
    let st = ready_state()?;
    st.alloc
        .containing(DevicePtr(ptr.0))
        .filter(|r| r.kind == AllocationKind::SubAllocated)
}

/// A query about `ptr` (its range or attributes) made by `call`: where `ptr` is in an
/// allocation a swap-out staged in pageable memory (its address maps nothing until it comes
/// back: docs/swap.md, "Pageable staging"), the query passes the swap gate as a touching call
/// does, so the process comes back first and the driver answers as for resident memory.
/// Otherwise (one relaxed load while swapping is off) the call as it is.
fn query(ptr: CUdeviceptr, call: impl FnOnce() -> Result<(), CUresult>) -> Result<(), CUresult> {
    let staged =
        !crate::swap::off() && ready_state().is_some_and(|st| st.host_backed.staged_at(ptr));
    if staged {
        crate::swap::touching(call)
    } else {
        call()
    }
}

pub(crate) unsafe fn cuMemGetAddressRange_v2(
    forward: impl Forward,
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> Result<(), CUresult> {
    let Some(range) = suballocation(dptr) else {
        return query(dptr, || forward(real::cuda()?));
    };
    // Both out-pointers are optional in the driver API.
    if !pbase.is_null() {
        // SAFETY: non-null caller out-pointer.
        unsafe { *pbase = CUdeviceptr(range.base.0) };
    }
    if !psize.is_null() {
        // SAFETY: non-null caller out-pointer.
        unsafe { *psize = range.size as usize };
    }
    Ok(())
}

/// Writes a sub-allocation's range attribute to `data`; false for other attributes.
///
/// # Safety
/// `data` must be valid for the attribute's type (the driver API contract).
unsafe fn write_range_attribute(
    range: &vgpu_alloc_core::AddressRange,
    attr: CUpointer_attribute,
    data: *mut c_void,
) -> bool {
    if data.is_null() {
        return false;
    }
    match attr {
        // SAFETY: RANGE_START_ADDR writes a CUdeviceptr, RANGE_SIZE a size_t.
        CUpointer_attribute::RANGE_START_ADDR => unsafe {
            data.cast::<CUdeviceptr>().write(CUdeviceptr(range.base.0))
        },
        // SAFETY: as above.
        CUpointer_attribute::RANGE_SIZE => unsafe {
            data.cast::<usize>().write(range.size as usize)
        },
        _ => return false,
    }
    true
}

pub(crate) unsafe fn cuPointerGetAttribute(
    forward: impl Forward,
    data: *mut c_void,
    attribute: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    if matches!(
        attribute,
        CUpointer_attribute::RANGE_START_ADDR | CUpointer_attribute::RANGE_SIZE
    ) {
        if let Some(range) = suballocation(ptr) {
            // SAFETY: `data` per the attribute's contract.
            if unsafe { write_range_attribute(&range, attribute, data) } {
                return Ok(());
            }
        }
    }
    query(ptr, || forward(real::cuda()?))
}

/// `cuPointerGetAttributes`: the driver's answer (after a swap-in where `ptr` was staged,
/// [`query`]), then a sub-allocation's range made its own.
pub(crate) unsafe fn cuPointerGetAttributes(
    forward: impl Forward,
    num_attributes: c_uint,
    attributes: *mut CUpointer_attribute,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    query(ptr, || forward(real::cuda()?))?;
    // SAFETY: the arrays the driver just read and filled, per the caller's contract.
    unsafe { range_attributes(num_attributes, attributes, data, ptr) }
}

/// `cuPointerGetAttributes` succeeded: a sub-allocation's range is its own, not its region's.
///
/// # Safety
/// The arrays the driver just read and filled (`num_attributes` entries each, or null).
unsafe fn range_attributes(
    num_attributes: c_uint,
    attributes: *mut CUpointer_attribute,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    if attributes.is_null() || data.is_null() {
        return Ok(());
    }
    if let Some(range) = suballocation(ptr) {
        for i in 0..num_attributes as usize {
            // SAFETY: both arrays have `num_attributes` entries (driver contract; the driver
            // just read them).
            let (attr, out) = unsafe { (*attributes.add(i), *data.add(i)) };
            // SAFETY: `out` per the attribute's contract.
            unsafe { write_range_attribute(&range, attr, out) };
        }
    }
    Ok(())
}

pub(crate) fn cuIpcGetMemHandle(
    forward: impl Forward,
    _handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> Result<(), CUresult> {
    if suballocation(dptr).is_some() {
        vlog!(
            ERROR,
            "cuIpcGetMemHandle({:#x}): the pointer is sub-allocated and cannot be shared between processes; \
             run with VGPU_SUBALLOC=0 to give every allocation its own device memory",
            dptr.0
        );
        return Err(CUresult::INVALID_VALUE);
    }
    if let Some(st) = ready_state().filter(|st| st.host_backed.any())
        && st.host_backed.range(dptr).is_some()
    {
        vlog!(
            ERROR,
            "cuIpcGetMemHandle({:#x}): the allocation is VMM memory of the hook's (host-backed, \
             or movable under VGPU_SWAP_MOVABLE=1), which has no IPC handle; run with \
             VGPU_SWAP_MOVABLE=0 (and without host backing) to share it between processes",
            dptr.0
        );
        return Err(CUresult::INVALID_VALUE);
    }
    forward(real::cuda()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{D, ledger};
    use vgpu_alloc_core::{Allocator, AllocatorConfig, MockBackend};

    /// A pitched allocation whose estimate and real size together exceed the limit, while
    /// either alone fits: correcting the charge must succeed and leave only the real size
    /// charged (taking the exact charge before dropping the estimate gave a false OOM).
    #[test]
    fn a_pitched_charge_is_corrected_in_place_near_the_limit() {
        let a = Allocator::new(
            AllocatorConfig::default(),
            MockBackend::new(),
            ledger(100 << 20),
        )
        .unwrap();
        let (dev, ctx) = (D, ContextId(1));
        let mut pending = a
            .begin_record(AllocationKind::Pitched, dev, ctx, 60 << 20, 60 << 20)
            .unwrap();
        correct_charge(&mut pending, 70 << 20).unwrap();
        assert_eq!(a.usage(dev).used, 70 << 20, "only the real size is charged");
        pending.commit(0x7000_0000).unwrap();
        assert_eq!(a.usage(dev).used, 70 << 20);
        let mut too_big = a
            .begin_record(AllocationKind::Pitched, dev, ctx, 20 << 20, 20 << 20)
            .unwrap();
        assert!(matches!(
            correct_charge(&mut too_big, 40 << 20),
            Err(AllocError::OutOfMemory(_))
        ));
        assert_eq!(
            a.usage(dev).used,
            90 << 20,
            "a refused correction keeps the estimate"
        );
        drop(too_big);
        assert_eq!(a.usage(dev).used, 70 << 20);
    }
}
