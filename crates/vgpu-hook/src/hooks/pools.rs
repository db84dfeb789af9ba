//! Stream-ordered allocation and pools.

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

pub(super) fn pool_device(st: &Ready, cuda: &Cuda, pool: CUmemoryPool) -> Option<DeviceIndex> {
    if let Some(m) = st.pools.get(pool as usize) {
        return Some(m.device);
    }
    driver::find_pool_device(cuda, pool).and_then(dev_index)
}

/// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` (`pool` given) and their `_ptsz` forms:
/// `real` performs the call.
pub(super) fn alloc_async(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    per_thread: bool,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let st = tri!(state::ready());
    let cuda = tri!(real::cuda());
    if dptr.is_null() || bytesize == 0 {
        return real();
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
                return real(); // the driver reports the bad stream
            };
            match idx {
                Ok(t) => Some(t),
                // The pool cannot be named (a driver without cuDeviceGetMemPool): charge the
                // allocation itself, so it is still counted and released on free.
                Err(idx) => return alloc_async_unpooled(st, cuda, dptr, bytesize, idx, real),
            }
        }
    };
    let Some((pool, idx)) = target else {
        vlog!(
            DEBUG,
            "stream-ordered allocation from an untracked (host) pool: passed through"
        );
        return real();
    };
    if driver::stream_capturing(cuda, stream, per_thread) {
        // Becomes a graph memory node, charged when the graph is launched or uploaded (graph
        // memory is measured from now on). No pool query: during a global-mode capture
        // cuMemPoolGetAttribute invalidates the capture (seen on the H200, GPU run 2).
        st.graph_mem_possible.store(true, Ordering::Relaxed);
        return match refuse_unless_it_fits(st, idx, bytesize as u64) {
            Ok(()) => real(),
            Err(r) => r,
        };
    }
    // The part of the request the pool cannot serve from memory it already holds.
    let reserved =
        driver::pool_attr(cuda, pool, CUmemPool_attribute::RESERVED_MEM_CURRENT).unwrap_or(0);
    let used =
        driver::pool_attr(cuda, pool, CUmemPool_attribute::USED_MEM_CURRENT).unwrap_or(reserved);
    let need = (bytesize as u64).saturating_sub(reserved.saturating_sub(used));
    let Some(need) = align_up(need, POOL_GRANULE) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let reserve = || {
        st.pools
            .reserve_tentative(st.ledger(), idx, need)
            .map_err(AllocError::OutOfMemory)
    };
    let tentative = tri!(with_pool_retry(st, cuda, reserve).map_err(alloc_err));
    let r = real();
    if !r.is_success() {
        st.pools.cancel(st.ledger(), idx, tentative);
        return r;
    }
    settle_pool(st, cuda, pool, idx, tentative);
    reconcile_if_due(st, cuda, idx);
    r
}

/// Stream-ordered allocation charged per allocation (rounded to the pool granule), for when
/// the pool cannot be measured.
pub(super) fn alloc_async_unpooled(
    st: &Ready,
    cuda: &Cuda,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    idx: DeviceIndex,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(charge) = align_up(bytesize as u64, POOL_GRANULE) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let ctx = driver::current_context(cuda).unwrap_or(std::ptr::null_mut());
    let pending = tri!(
        with_pool_retry(st, cuda, || st.alloc.begin_record(
            AllocationKind::PoolAsync,
            idx,
            ctx_id(ctx),
            bytesize as u64,
            charge
        ))
        .map_err(alloc_err)
    );
    let r = real();
    if r.is_success() {
        // SAFETY: the driver filled the non-null out-pointer.
        if let Err(e) = pending.commit(unsafe { *dptr }.0) {
            commit_err(e, "a stream-ordered allocation");
        }
    }
    r
}

pub(crate) unsafe fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, None, stream, false, || {
        call!(cuda, h.cuMemAllocAsync(dptr, bytesize, stream))
    })
}

pub(crate) unsafe fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, None, stream, true, || {
        call!(cuda, h.cuMemAllocAsync_ptsz(dptr, bytesize, stream))
    })
}

pub(crate) unsafe fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, Some(pool), stream, false, || {
        call!(
            cuda,
            h.cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream)
        )
    })
}

pub(crate) unsafe fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    let cuda = tri!(real::cuda());
    alloc_async(dptr, bytesize, Some(pool), stream, true, || {
        call!(
            cuda,
            h.cuMemAllocFromPoolAsync_ptsz(dptr, bytesize, pool, stream)
        )
    })
}

/// `cuMemFreeAsync[_ptsz]`: frees whatever it is given. Memory from the synchronous
/// allocators is released from our table; sub-allocated chunks are reused only after the
/// stream has reached the free (we synchronize it, since the region stays allocated).
pub(super) fn free_async(
    dptr: CUdeviceptr,
    stream: CUstream,
    real: impl FnOnce() -> CUresult,
    sync: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(st) = ready_state().filter(|_| dptr.0 != 0) else {
        return real();
    };
    let Some(range) = st
        .alloc
        .containing(DevicePtr(dptr.0))
        .filter(|r| r.base.0 == dptr.0)
    else {
        return real(); // pool memory (charged per pool) or unknown: the driver decides
    };
    if range.kind == AllocationKind::SubAllocated {
        let r = sync();
        if !r.is_success() {
            return r;
        }
        return match st.alloc.free(DevicePtr(dptr.0)) {
            Ok(_) | Err(FreeError::NotTracked) => CUresult::SUCCESS,
            Err(FreeError::Backend(b)) => CUresult(b.code),
            Err(FreeError::Internal(why)) => {
                vlog!(
                    ERROR,
                    "internal accounting error freeing {:#x}: {why}",
                    dptr.0
                );
                CUresult::UNKNOWN
            }
        };
    }
    let _ = stream;
    let r = real();
    if r.is_success() {
        let _ = st.alloc.release_record(range.kind, dptr.0);
    }
    r
}

pub(crate) unsafe fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    free_async(
        dptr,
        stream,
        || call!(cuda, h.cuMemFreeAsync(dptr, stream)),
        || call!(cuda, h.cuStreamSynchronize(stream)),
    )
}

pub(crate) unsafe fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    free_async(
        dptr,
        stream,
        || call!(cuda, h.cuMemFreeAsync_ptsz(dptr, stream)),
        || call!(cuda, h.cuStreamSynchronize_ptsz(stream)),
    )
}

pub(crate) unsafe fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemPoolCreate(pool, props));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        // SAFETY: the driver read `props` and wrote `*pool`.
        if let (Some(p), Some(handle)) = (unsafe { read_in(props) }, unsafe { read_back(pool) }) {
            if p.location.type_ == CUmemLocationType::DEVICE {
                if let Some(idx) = dev_index(CUdevice(p.location.id)) {
                    st.pools.register(handle as usize, idx);
                }
            }
        }
    }
    r
}

pub(crate) unsafe fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemPoolDestroy(pool));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        st.pools.remove(st.ledger(), pool as usize);
    }
    r
}

pub(crate) unsafe fn cuMemPoolTrimTo(pool: CUmemoryPool, min_bytes_to_keep: usize) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuMemPoolTrimTo(pool, min_bytes_to_keep));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        if let Some(m) = st.pools.get(pool as usize) {
            settle_pool(st, cuda, pool, m.device, 0);
        }
    }
    r
}
