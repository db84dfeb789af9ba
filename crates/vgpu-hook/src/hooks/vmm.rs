//! Virtual memory management: a handle is charged at creation on its own device and
//! released with its last reference.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;
use crate::host_backing::program_vmm::Released;
use std::ffi::{c_uint, c_void};

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
    let Some(pending) = charge_then_forward(st, cuda, &forward, &charge, host)? else {
        return Ok(());
    };
    // SAFETY: the driver filled the non-null out-pointer.
    let again = || {
        forward(cuda)?;
        // SAFETY: the driver filled the non-null out-pointer again.
        Ok(unsafe { *handle })
    };
    // SAFETY: as above.
    let made = unseen_value(cuda, unsafe { *handle }, again, |v| {
        st.host_backed.program.in_use(v)
    });
    let made = match made {
        Ok(h) => h,
        Err(code) => {
            drop(pending); // the charge goes back
            return Err(code);
        }
    };
    // SAFETY: non-null out-pointer (checked above).
    unsafe { write_out(handle, made) }?;
    commit(pending, made.0, charge.what);
    st.host_backed
        .program
        .created(made, (idx, CUdevice(p.location.id)), charge.charge, &p);
    reconcile_if_due(st, cuda, idx);
    Ok(())
}

/// A fresh handle whose value the program does not know already: a handle that moved keeps
/// the value its `cuMemCreate` answered, and a driver that hands that value out again for new
/// memory would make the program's value name two allocations. Such a handle is kept while
/// the driver makes another (so it cannot answer the same value), then released.
fn unseen_value(
    cuda: &Cuda,
    first: CUmemGenericAllocationHandle,
    again: impl Fn() -> Result<CUmemGenericAllocationHandle, CUresult>,
    in_use: impl Fn(u64) -> bool,
) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let mut held = Vec::new();
    let mut h = first;
    let answer = loop {
        if !in_use(h.0) {
            break Ok(h);
        }
        vlog!(
            INFO,
            "the driver answered a cuMemCreate or cuMemImportFromShareableHandle with {:#x}, \
             the value of a moved handle of the program's: asking it for another",
            h.0
        );
        held.push(h);
        if held.len() > 8 {
            break Err(CUresult::OUT_OF_MEMORY);
        }
        h = match again() {
            Ok(h) => h,
            Err(code) => break Err(code),
        };
    };
    for x in held {
        let _ = driver::mem_release(cuda, x);
    }
    answer
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

/// `cuMemRelease`: a handle the program made on a device is counted here (it may have
/// moved: only its last reference reaches the driver, as its current handle); any other goes
/// to the driver.
pub(crate) fn cuMemRelease(
    forward: impl Forward,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state() else {
        return forward(cuda);
    };
    match st.host_backed.program.release(cuda, st.ledger(), handle)? {
        Released::Gone => {
            let _ = st.alloc.release_record(AllocationKind::VmmHandle, handle.0);
            Ok(())
        }
        Released::Kept => Ok(()),
        Released::NotOurs => {
            forward(cuda)?;
            vmm_released(st, handle)
        }
    }
}

/// `cuMemRelease` of a handle the program table does not hold succeeded: one reference
/// fewer; the last one releases the charge.
fn vmm_released(st: &Ready, handle: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
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
    cuda: &Cuda,
    handle: *mut CUmemGenericAllocationHandle,
) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    // SAFETY: the driver filled the out-pointer (it fails on null).
    let Some(h) = (unsafe { read_back(handle) }) else {
        return Ok(());
    };
    // A handle of the program's: its own value, whatever handle holds the memory now.
    if let Some(value) = st.host_backed.program.retained(cuda, h) {
        // SAFETY: the same out-pointer.
        return unsafe { write_out(handle, CUmemGenericAllocationHandle(value)) };
    }
    // The same handle value as cuMemCreate returned, one reference more.
    if st.alloc.lookup(AllocationKind::VmmHandle, h.0).is_some() {
        *locked(&st.vmm_extra_refs).entry(h.0).or_insert(0) += 1;
    }
    Ok(())
}

/// `cuMemMap`: the program's handle translated to the one holding its memory now, and the
/// mapping recorded.
pub(crate) fn cuMemMap(
    forward: impl Forward,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state() else {
        return forward(cuda);
    };
    let program = &st.host_backed.program;
    translated(cuda, program, handle, forward, |real| {
        // SAFETY: the program's arguments, its handle translated (the driver validates all).
        unsafe { driver::have(cuda.h.cuMemMap)?(ptr, size, offset, real, flags) }.ok()
    })?;
    program.mapped(ptr.0, size as u64, offset as u64, handle);
    Ok(())
}

/// `cuMemUnmap` succeeded: the mappings it ended are forgotten, and a handle the program had
/// released goes with its last one (its charge too).
pub(crate) fn vmm_unmapped(cuda: &Cuda, ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    let program = &st.host_backed.program;
    for value in program.unmapped(cuda, st.ledger(), ptr.0, size as u64) {
        let _ = st.alloc.release_record(AllocationKind::VmmHandle, value);
    }
    Ok(())
}

/// The most access descriptors a `cuMemSetAccess` is read for (one per device and the host).
const MAX_ACCESS_DESCS: usize = 64;

/// `cuMemSetAccess` succeeded: the access is recorded with the mappings it covers (a move
/// sets it again).
///
/// # Safety
/// `desc` points to `count` descriptors (the driver just read them).
pub(crate) unsafe fn vmm_access_set(
    _cuda: &Cuda,
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    if desc.is_null() || count == 0 {
        return Ok(());
    }
    // SAFETY: `count` descriptors the driver accepted (bounded: more than any machine has
    // locations; the rest are ignored, so a range with more is left partial and stays put).
    let descs = unsafe { std::slice::from_raw_parts(desc, count.min(MAX_ACCESS_DESCS)) };
    st.host_backed
        .program
        .access_set(ptr.0, size as u64, descs, count <= MAX_ACCESS_DESCS);
    Ok(())
}

/// `cuMemExportToShareableHandle`: another process may map what it exports, so the handle
/// never moves from then on.
pub(crate) fn cuMemExportToShareableHandle(
    forward: impl Forward,
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: u64,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state() else {
        return forward(cuda);
    };
    let program = &st.host_backed.program;
    translated(cuda, program, handle, forward, |real| {
        let export = driver::have(cuda.h.cuMemExportToShareableHandle)?;
        // SAFETY: the program's arguments, its handle translated.
        unsafe { export(shareable, real, handle_type, flags) }.ok()
    })?;
    program.stays(handle, "it was exported to a shareable handle");
    Ok(())
}

/// `cuMemImportFromShareableHandle`: memory another process (or this one) exported. It is
/// the exporter's, charged there, and the exporter may be writing it: recorded so that a
/// swap-out leaves it (and names it) and nothing charges it here. A value the program still
/// uses for a moved handle is not answered (the driver is asked again, as for `cuMemCreate`),
/// and one the program's own live handle has (an in-process import of its own export) counts
/// as a retain of it.
pub(crate) unsafe fn cuMemImportFromShareableHandle(
    forward: impl Forward,
    handle: *mut CUmemGenericAllocationHandle,
    _os_handle: *mut c_void,
    _handle_type: c_uint,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state() else {
        return forward(cuda);
    };
    forward(cuda)?;
    // SAFETY: the driver filled the out-pointer (it fails on null).
    let Some(first) = (unsafe { read_back(handle) }) else {
        return Ok(());
    };
    let program = &st.host_backed.program;
    let again = || {
        forward(cuda)?;
        // SAFETY: the driver filled the out-pointer again.
        unsafe { read_back(handle) }.ok_or(CUresult::INVALID_VALUE)
    };
    let h = unseen_value(cuda, first, again, |v| program.in_use(v))?;
    if let Some(value) = program.retained(cuda, h) {
        // SAFETY: the same out-pointer.
        return unsafe { write_out(handle, CUmemGenericAllocationHandle(value)) };
    }
    // SAFETY: the same out-pointer.
    unsafe { write_out(handle, h) }?;
    let device = driver::handle_device(cuda, h);
    if let Some(ordinal) = device
        && let Some(idx) = dev_index(ordinal)
    {
        program.imported(h, (idx, ordinal));
    }
    Ok(())
}

/// `cuMemGetAllocationPropertiesFromHandle` of the program's handle, translated.
pub(crate) fn cuMemGetAllocationPropertiesFromHandle(
    forward: impl Forward,
    prop: *mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state() else {
        return forward(cuda);
    };
    translated(cuda, &st.host_backed.program, handle, forward, |real| {
        // SAFETY: the program's arguments, its handle translated.
        unsafe { driver::have(cuda.h.cuMemGetAllocationPropertiesFromHandle)?(prop, real) }.ok()
    })
}

/// `cuMulticastBindMem`: the memory handle translated; bound memory is reached through the
/// multicast object (other GPUs, other processes), so it never moves from then on.
pub(crate) fn cuMulticastBindMem(
    forward: impl Forward,
    mc_handle: CUmemGenericAllocationHandle,
    mc_offset: usize,
    mem_handle: CUmemGenericAllocationHandle,
    mem_offset: usize,
    size: usize,
    flags: u64,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state() else {
        return forward(cuda);
    };
    let program = &st.host_backed.program;
    translated(cuda, program, mem_handle, forward, |real| {
        let bind = driver::have(cuda.h.cuMulticastBindMem)?;
        // SAFETY: the program's arguments, its memory handle translated.
        unsafe { bind(mc_handle, mc_offset, real, mem_offset, size, flags) }.ok()
    })?;
    program.stays(mem_handle, "it is bound to a multicast object");
    Ok(())
}

/// A call that names the program's VMM `handle`: forwarded as it came while the driver's
/// handle is the program's value (it never moved), else made by `with_real` with the handle
/// that holds the memory now.
fn translated(
    cuda: &Cuda,
    program: &crate::host_backing::program_vmm::ProgramVmm,
    handle: CUmemGenericAllocationHandle,
    forward: impl Forward,
    with_real: impl FnOnce(CUmemGenericAllocationHandle) -> Result<(), CUresult>,
) -> Result<(), CUresult> {
    match program.translate(handle) {
        real if real == handle => forward(cuda),
        real => with_real(real),
    }
}
