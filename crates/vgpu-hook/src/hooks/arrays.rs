//! Arrays.

use super::*;

/// Creates an array-like object of `bytes`, charged as `kind` in the current context.
pub(super) fn create_array(
    kind: AllocationKind,
    bytes: Option<u64>,
    real: impl FnOnce() -> CUresult,
    handle: impl FnOnce() -> u64,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    let Some(bytes) = bytes else { return real() }; // no descriptor: the driver reports it
    if bytes == 0 {
        return real(); // sparse / deferred mapping: paid by cuMemCreate
    }
    let Ok((ctx, dev)) = driver::current(cuda) else {
        return real();
    };
    let Some(idx) = dev_index(dev) else {
        return real();
    };
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            kind,
            idx,
            ctx_id(ctx),
            bytes,
            bytes
        ))
        .map_err(alloc_err)
    );
    let r = real();
    if r.is_success() {
        if let Err(e) = pending.commit(handle()) {
            commit_err(e, "an array");
        }
        reconcile_if_due(st, cuda, idx);
    }
    r
}

pub(super) fn destroy_array(kind: AllocationKind, key: u64, r: CUresult) -> CUresult {
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        let _ = st.alloc.release_record(kind, key);
    }
    r
}

pub(crate) unsafe fn cuArrayCreate_v2(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes = unsafe { read_in(desc) }.map(|d| array2d_bytes(&d).unwrap_or(u64::MAX));
    if handle.is_null() {
        return call!(cuda, h.cuArrayCreate_v2(handle, desc));
    }
    // SAFETY: the driver filled the non-null out-pointer on success.
    create_array(
        AllocationKind::Array,
        bytes,
        || call!(cuda, h.cuArrayCreate_v2(handle, desc)),
        || unsafe { *handle } as u64,
    )
}

pub(crate) unsafe fn cuArray3DCreate_v2(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes = unsafe { read_in(desc) }.map(|d| array3d_bytes(&d).unwrap_or(u64::MAX));
    if handle.is_null() {
        return call!(cuda, h.cuArray3DCreate_v2(handle, desc));
    }
    // SAFETY: the driver filled the non-null out-pointer on success.
    create_array(
        AllocationKind::Array,
        bytes,
        || call!(cuda, h.cuArray3DCreate_v2(handle, desc)),
        || unsafe { *handle } as u64,
    )
}

pub(crate) unsafe fn cuArrayDestroy(handle: CUarray) -> CUresult {
    let cuda = tri!(real::cuda());
    destroy_array(
        AllocationKind::Array,
        handle as u64,
        call!(cuda, h.cuArrayDestroy(handle)),
    )
}

pub(crate) unsafe fn cuMipmappedArrayCreate(
    handle: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    num_levels: c_uint,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `desc` is null or valid (driver contract).
    let bytes =
        unsafe { read_in(desc) }.map(|d| mipmapped_bytes(&d, num_levels).unwrap_or(u64::MAX));
    if handle.is_null() {
        return call!(cuda, h.cuMipmappedArrayCreate(handle, desc, num_levels));
    }
    create_array(
        AllocationKind::MipmappedArray,
        bytes,
        || call!(cuda, h.cuMipmappedArrayCreate(handle, desc, num_levels)),
        // SAFETY: the driver filled the non-null out-pointer on success.
        || unsafe { *handle } as u64,
    )
}

pub(crate) unsafe fn cuMipmappedArrayDestroy(handle: CUmipmappedArray) -> CUresult {
    let cuda = tri!(real::cuda());
    destroy_array(
        AllocationKind::MipmappedArray,
        handle as u64,
        call!(cuda, h.cuMipmappedArrayDestroy(handle)),
    )
}
