//! Arrays: charged at creation from their descriptor, in the current context.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// Creates an array-like object of `bytes` (`None`: no descriptor), charged as `kind` in the
/// current context; `handle` reads the new object's handle after the driver made it.
fn charge_array(
    cuda: &Cuda,
    forward: impl Forward,
    kind: AllocationKind,
    bytes: Option<u64>,
    handle: impl FnOnce() -> u64,
) -> Result<(), CUresult> {
    let st = ready()?;
    let Some(bytes) = bytes else {
        return forward(cuda); // no descriptor: the driver reports it
    };
    if bytes == 0 {
        return forward(cuda); // sparse / deferred mapping: paid by cuMemCreate
    }
    let Ok((ctx, dev)) = driver::current(cuda) else {
        return forward(cuda);
    };
    let Some(idx) = dev_index(dev) else {
        return forward(cuda);
    };
    let charge = Charge {
        kind,
        device: idx,
        context: ctx_id(ctx),
        requested: bytes,
        charge: bytes,
        what: "an array",
    };
    charge_and_forward(st, cuda, forward, charge, handle)?;
    reconcile_if_due(st, cuda, idx);
    Ok(())
}

/// A plain array's descriptor (`cuArrayCreate`'s 2D one, `cuArray3DCreate`'s 3D one).
pub(crate) trait ArrayDescriptor: Copy {
    /// What the array takes on the device (`None`: too large to count).
    fn bytes(&self) -> Option<u64>;
}

impl ArrayDescriptor for CUDA_ARRAY_DESCRIPTOR {
    fn bytes(&self) -> Option<u64> {
        array2d_bytes(self)
    }
}

impl ArrayDescriptor for CUDA_ARRAY3D_DESCRIPTOR {
    fn bytes(&self) -> Option<u64> {
        array3d_bytes(self)
    }
}

/// `cuArrayCreate_v2` and `cuArray3DCreate_v2`.
///
/// # Safety
/// `handle` and `desc` as the driver API's contract requires.
pub(crate) unsafe fn create_array<D: ArrayDescriptor>(
    forward: impl Forward,
    handle: *mut CUarray,
    desc: *const D,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes = unsafe { read_in(desc) }.map(|d| d.bytes().unwrap_or(u64::MAX));
    if handle.is_null() {
        return forward(cuda);
    }
    // SAFETY: the driver filled the non-null out-pointer (read only on success).
    let handle = || unsafe { *handle } as u64;
    charge_array(cuda, forward, AllocationKind::Array, bytes, handle)
}

pub(crate) unsafe fn cuMipmappedArrayCreate(
    forward: impl Forward,
    handle: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    num_levels: c_uint,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes =
        unsafe { read_in(desc) }.map(|d| mipmapped_bytes(&d, num_levels).unwrap_or(u64::MAX));
    if handle.is_null() {
        return forward(cuda);
    }
    // SAFETY: the driver filled the non-null out-pointer (read only on success).
    let handle = || unsafe { *handle } as u64;
    charge_array(cuda, forward, AllocationKind::MipmappedArray, bytes, handle)
}

/// `cuArrayDestroy` succeeded: its charge goes.
pub(crate) fn array_destroyed(_cuda: &Cuda, handle: CUarray) -> Result<(), CUresult> {
    destroyed(AllocationKind::Array, handle as u64)
}

/// `cuMipmappedArrayDestroy` succeeded: its charge goes.
pub(crate) fn mipmapped_array_destroyed(
    _cuda: &Cuda,
    handle: CUmipmappedArray,
) -> Result<(), CUresult> {
    destroyed(AllocationKind::MipmappedArray, handle as u64)
}

fn destroyed(kind: AllocationKind, key: u64) -> Result<(), CUresult> {
    if let Some(st) = ready_state() {
        let _ = st.alloc.release_record(kind, key);
    }
    Ok(())
}
