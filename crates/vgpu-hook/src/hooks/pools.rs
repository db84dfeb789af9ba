//! Stream-ordered allocation and pools: a pool is charged what it holds, re-measured at
//! allocations, frees, trims and sync points.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// Re-measures one pool and settles its charge.
pub(super) fn settle_pool(
    st: &Ready,
    cuda: &Cuda,
    pool: CUmemoryPool,
    device: DeviceIndex,
    tentative: u64,
) {
    let measured = match driver::pool_attr(cuda, pool, CUmemPool_attribute::RESERVED_MEM_CURRENT) {
        Ok(m) => m,
        // Cannot measure: keep what was charged, plus the tentative reservation.
        Err(_) => st.pools.get(pool as usize).map_or(0, |m| m.accounted) + tentative,
    };
    let m = st
        .pools
        .settle(st.ledger(), pool as usize, device, measured, tentative);
    if m.shortfall > 0 {
        vlog!(
            WARN,
            "device {}: memory pool {:#x} holds {} bytes more than the limit allows; charged when room appears",
            m.device,
            pool as usize,
            m.shortfall
        );
    }
}

/// Re-measures every tracked pool (sync points, frees, before refusing an allocation).
pub(super) fn settle_all_pools(st: &Ready, cuda: &Cuda) {
    for key in st.pools.keys() {
        if let Some(m) = st.pools.get(key) {
            settle_pool(st, cuda, key as CUmemoryPool, m.device, 0);
        }
    }
}

fn pool_device(st: &Ready, cuda: &Cuda, pool: CUmemoryPool) -> Option<DeviceIndex> {
    if let Some(m) = st.pools.get(pool as usize) {
        return Some(m.device);
    }
    driver::find_pool_device(cuda, pool).and_then(dev_index)
}

/// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` (`pool` given), either stream variant.
///
/// # Safety
/// `dptr` as the driver API's contract requires.
unsafe fn alloc_async(
    variant: StreamKind,
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let st = ready()?;
    if dptr.is_null() || bytesize == 0 {
        return forward(cuda);
    }
    let target = match pool {
        Some(p) => pool_device(st, cuda, p).map(|d| (p, d)),
        None => {
            let Some(idx) = driver::stream_device(cuda, stream).ok().and_then(|dev| {
                let idx = dev_index(dev)?;
                match driver::device_mem_pool(cuda, dev) {
                    Ok(p) => Some(Ok((p, idx))),
                    Err(_) => Some(Err(idx)),
                }
            }) else {
                return forward(cuda); // the driver reports the bad stream
            };
            match idx {
                Ok(t) => Some(t),
                // The pool cannot be named (a driver without cuDeviceGetMemPool): charge the
                // allocation itself, so it is still counted and released on free.
                Err(idx) => {
                    // SAFETY: `dptr` is non-null (checked above) and per this function's
                    // contract.
                    return unsafe { alloc_async_unpooled(st, cuda, forward, dptr, bytesize, idx) };
                }
            }
        }
    };
    let Some((pool, idx)) = target else {
        vlog!(
            DEBUG,
            "stream-ordered allocation from an untracked (host) pool: passed through"
        );
        return forward(cuda);
    };
    let per_thread = variant == StreamKind::PerThread;
    if driver::stream_capturing(cuda, stream, per_thread) {
        // Becomes a graph memory node, charged when the graph is launched or uploaded (graph
        // memory is measured from now on). No pool query: during a global-mode capture
        // cuMemPoolGetAttribute invalidates the capture (the driver's rule:
        // gpu-tests/capture_rules.sh).
        st.graph_mem_possible.store(true, Ordering::Relaxed);
        refuse_unless_it_fits(st, idx, bytesize as u64)?;
        return forward(cuda);
    }
    // The part of the request the pool cannot serve from memory it already holds.
    let reserved =
        driver::pool_attr(cuda, pool, CUmemPool_attribute::RESERVED_MEM_CURRENT).unwrap_or(0);
    let used =
        driver::pool_attr(cuda, pool, CUmemPool_attribute::USED_MEM_CURRENT).unwrap_or(reserved);
    let need = (bytesize as u64).saturating_sub(reserved.saturating_sub(used));
    let need = align_up(need, DEVICE_PAGE).ok_or(CUresult::OUT_OF_MEMORY)?;
    // Past the device, the limit or the reserve the allocation is host-backed as cuMemAlloc's
    // is (usable at once, which stream order allows; `cuMemFreeAsync` frees it once the
    // stream reaches the free).
    // SAFETY: `dptr` is non-null (checked above) and per this function's contract.
    let host = |refused| unsafe { host_backed_async(st, cuda, idx, dptr, bytesize, refused) };
    if need > 0
        && let Some(free) = reserve_breach(st, cuda, idx, need)
    {
        return keep_reserve(st, (idx, need), free, host);
    }
    let reserve = || {
        st.pools
            .reserve_tentative(st.ledger(), idx, need)
            .map_err(AllocError::OutOfMemory)
    };
    let tentative = match with_pool_retry(st, cuda, reserve) {
        Ok(t) => t,
        Err(refused) => return host(refused),
    };
    if let Err(r) = forward(cuda) {
        st.pools.cancel(st.ledger(), idx, tentative);
        return match r {
            CUresult::OUT_OF_MEMORY => host(AllocError::Backend(vgpu_alloc_core::BackendError {
                code: r.0,
            })),
            _ => Err(r),
        };
    }
    settle_pool(st, cuda, pool, idx, tentative);
    if need > 0 {
        // The pool grew: the driver took memory for it beyond what the pool reports (about
        // 70 MiB for PyTorch's 2.5 GiB pool on the H200). Reconciled at every growth, not at
        // the rate limit: allocations in quick succession would otherwise leave the last
        // growths uncharged until some other call came by (issue 12). Growth is rare (a
        // pool keeps what it reserved) and costs a driver allocation anyway.
        st.residual.ran_now();
        let _ = reconcile(st, cuda, idx, OverLimit::Charge);
        st.pool_grew.store(true, Ordering::Relaxed);
    } else {
        reconcile_if_due(st, cuda, idx);
    }
    Ok(())
}

/// A stream-ordered allocation the pool could not serve (`refused`), in host memory if it
/// may be ([`host_backed_instead`]) and the current context is on the pool's device (the
/// allocation belongs to a context: destroying it frees the memory, as for the pool's).
///
/// # Safety
/// `dptr` is non-null and valid for a write (the driver API contract).
#[cold]
#[inline(never)]
unsafe fn host_backed_async(
    st: &Ready,
    cuda: &Cuda,
    idx: DeviceIndex,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    refused: AllocError,
) -> Result<(), CUresult> {
    let on_device = driver::current(cuda)
        .ok()
        .filter(|&(_, dev)| dev_index(dev) == Some(idx));
    let Some((ctx, dev)) = on_device else {
        return Err(alloc_err(refused));
    };
    let ptr = host_backed_instead(st, refused, || {
        st.host_backed
            .allocate(cuda, st.ledger(), idx, (dev, ctx), bytesize as u64)
    })?;
    // SAFETY: the caller's non-null out-pointer.
    unsafe { write_out(dptr, ptr) }
}

/// Stream-ordered allocation charged per allocation (rounded to the pool granule), for when
/// the pool cannot be measured.
///
/// # Safety
/// `dptr` is non-null and valid for a write (the driver API contract).
unsafe fn alloc_async_unpooled(
    st: &Ready,
    cuda: &Cuda,
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    idx: DeviceIndex,
) -> Result<(), CUresult> {
    let charge = align_up(bytesize as u64, DEVICE_PAGE).ok_or(CUresult::OUT_OF_MEMORY)?;
    let ctx = driver::current_context(cuda).unwrap_or(std::ptr::null_mut());
    let charge = Charge {
        kind: AllocationKind::PoolAsync,
        device: idx,
        context: ctx_id(ctx),
        requested: bytesize as u64,
        charge,
        what: "a stream-ordered allocation",
    };
    // SAFETY: read after success: the driver filled the non-null out-pointer.
    charge_and_forward(st, cuda, forward, charge, || unsafe { *dptr }.0)?;
    Ok(())
}

pub(crate) unsafe fn cuMemAllocAsync(
    variant: StreamKind,
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer, as the driver API's contract requires.
    unsafe { alloc_async(variant, forward, dptr, bytesize, None, stream) }
}

pub(crate) unsafe fn cuMemAllocFromPoolAsync(
    variant: StreamKind,
    forward: impl Forward,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer, as the driver API's contract requires.
    unsafe { alloc_async(variant, forward, dptr, bytesize, Some(pool), stream) }
}

/// `cuMemFreeAsync[_ptsz]`: frees whatever it is given. Memory from the synchronous
/// allocators is released from our table; sub-allocated chunks are reused only after the
/// stream has reached the free (we synchronize it, since the region stays allocated).
pub(crate) fn cuMemFreeAsync(
    variant: StreamKind,
    forward: impl Forward,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let Some(st) = ready_state().filter(|_| dptr.0 != 0) else {
        return forward(cuda);
    };
    if st.host_backed.any() && st.host_backed.range(dptr).is_some_and(|(b, _)| b == dptr.0) {
        // Unmapped at once: the stream must have reached the free first.
        driver::stream_synchronize(cuda, stream, variant == StreamKind::PerThread)?;
        st.host_backed.free(cuda, st.ledger(), dptr);
        return Ok(());
    }
    let Some(range) = st
        .alloc
        .containing(DevicePtr(dptr.0))
        .filter(|r| r.base.0 == dptr.0)
    else {
        return forward(cuda); // pool memory (charged per pool) or unknown: the driver decides
    };
    if range.kind == AllocationKind::SubAllocated {
        driver::stream_synchronize(cuda, stream, variant == StreamKind::PerThread)?;
        return match st.alloc.free(DevicePtr(dptr.0)) {
            Ok(_) | Err(FreeError::NotTracked) => Ok(()),
            Err(e) => Err(free_err(e, dptr)),
        };
    }
    forward(cuda)?;
    let _ = st.alloc.release_record(range.kind, dptr.0);
    Ok(())
}

/// `cuMemPoolCreate` succeeded: track a device pool.
///
/// # Safety
/// `pool` and `props` are the pointers the driver just wrote and read.
pub(crate) unsafe fn pool_created(
    _cuda: &Cuda,
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> Result<(), CUresult> {
    let Some(st) = ready_state() else {
        return Ok(());
    };
    // SAFETY: the driver read `props` and wrote `*pool`.
    if let (Some(p), Some(handle)) = (unsafe { read_in(props) }, unsafe { read_back(pool) }) {
        if p.location.type_ == CUmemLocationType::DEVICE {
            if let Some(idx) = dev_index(CUdevice(p.location.id)) {
                st.pools.register(handle as usize, idx);
            }
        }
    }
    Ok(())
}

/// `cuMemPoolDestroy` succeeded: its charge goes.
pub(crate) fn pool_destroyed(_cuda: &Cuda, pool: CUmemoryPool) -> Result<(), CUresult> {
    if let Some(st) = ready_state() {
        st.pools.remove(st.ledger(), pool as usize);
    }
    Ok(())
}

/// `cuMemPoolTrimTo` succeeded: the pool may hold less.
pub(crate) fn pool_trimmed(cuda: &Cuda, pool: CUmemoryPool) -> Result<(), CUresult> {
    if let Some(st) = ready_state() {
        if let Some(m) = st.pools.get(pool as usize) {
            settle_pool(st, cuda, pool, m.device, 0);
        }
    }
    Ok(())
}
