//! Virtual memory management, stream-ordered allocation and memory pools.

use super::*;

fn prop_bytes(p: &CUmemAllocationProp) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0..4].copy_from_slice(&p.type_.0.to_le_bytes());
    b[4..8].copy_from_slice(&p.requestedHandleTypes.to_le_bytes());
    b[8..12].copy_from_slice(&p.location.type_.0.to_le_bytes());
    b[12..16].copy_from_slice(&p.location.id.to_le_bytes());
    b[24] = p.allocFlags.compressionType;
    b[crate::state::PROP_GPU_DIRECT_RDMA] = p.allocFlags.gpuDirectRDMACapable;
    b[26..28].copy_from_slice(&p.allocFlags.usage.to_le_bytes());
    b
}

fn prop_from_bytes(b: &[u8; 32]) -> CUmemAllocationProp {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    CUmemAllocationProp {
        type_: vgpu_cuda_abi::CUmemAllocationType(u32_at(0)),
        requestedHandleTypes: u32_at(4),
        location: CUmemLocation {
            type_: vgpu_cuda_abi::CUmemLocationType(u32_at(8)),
            id: u32_at(12) as c_int,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: vgpu_cuda_abi::CUmemAllocationPropFlags {
            compressionType: b[24],
            gpuDirectRDMACapable: b[25],
            usage: u16::from_le_bytes([b[26], b[27]]),
            reserved: [0; 4],
        },
    }
}

/// Device ordinal of a device location, `None` for host locations: `CU_MEM_LOCATION_TYPE_`
/// `DEVICE` = 1, `HOST` = 2 (id ignored), `HOST_NUMA` = 3 (id: a NUMA node, the simulated host
/// has node 0), `HOST_NUMA_CURRENT` = 4 (id ignored), as in CUDA 12.2+'s `cuda.h`.
pub(super) fn location(loc: &CUmemLocation) -> CuResult<Option<i32>> {
    match loc.type_.0 {
        1 => Ok(Some(loc.id)),
        2 | 4 => Ok(None),
        3 if loc.id == 0 => Ok(None),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// How many host-located `cuMemCreate` allocations this process has made (test
/// instrumentation, not driver API).
#[unsafe(no_mangle)]
pub extern "C" fn vgpusim_host_creations() -> u64 {
    crate::state::HOST_CREATIONS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Bytes of device memory this process holds on the device of ordinal `ordinal` now
/// (contexts, modules, allocations), `u64::MAX` for no such device or no simulator (test
/// instrumentation, not driver API: whether a swap-out gave memory back to the device).
#[unsafe(no_mangle)]
pub extern "C" fn vgpusim_device_used(ordinal: c_int) -> u64 {
    let Ok(s) = crate::state::global() else {
        return u64::MAX;
    };
    s.phys(ordinal).map_or(u64::MAX, |d| {
        s.devices[d].used.load(std::sync::atomic::Ordering::Relaxed)
    })
}

exports! {
    cuMemCreate(h: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) true |s| {
        if h.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p: CUmemAllocationProp = inp!(prop);
        if p.type_.0 != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = s.mem_create(size as u64, location(&p.location)?, prop_bytes(&p))?;
        out!(h, CUmemGenericAllocationHandle(id));
        Ok(())
    }
    cuMemRelease(h: CUmemGenericAllocationHandle) false |s| { s.mem_release(h.0) }
    cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, _addr: CUdeviceptr, _flags: u64) false |s| {
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(ptr, CUdeviceptr(s.address_reserve(size as u64, align as u64)?));
        Ok(())
    }
    cuMemAddressFree(ptr: CUdeviceptr, size: usize) false |s| { s.address_free(ptr.0, size as u64) }
    cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, h: CUmemGenericAllocationHandle, flags: u64) false |s| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.mem_map(ptr.0, size as u64, offset as u64, h.0)
    }
    cuMemUnmap(ptr: CUdeviceptr, size: usize) false |s| { s.mem_unmap(ptr.0, size as u64) }
    cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) false |s| {
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.set_access(ptr.0, size as u64)
    }
    cuMemGetAccess(flags: *mut u64, _loc: *const CUmemLocation, ptr: CUdeviceptr) false |s| {
        s.set_access(ptr.0, 1)?;
        out!(flags, 3);
        Ok(())
    }
    cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, _option: CUmemAllocationGranularity_flags) false |s| {
        let p: CUmemAllocationProp = inp!(prop);
        if let Some(ord) = location(&p.location)? {
            s.phys(ord)?;
        }
        out!(g, crate::state::GRANULARITY as usize);
        Ok(())
    }
    cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, h: CUmemGenericAllocationHandle) false |s| {
        out!(prop, prop_from_bytes(&s.handle_props(h.0)?));
        Ok(())
    }
    cuMemRetainAllocationHandle(h: *mut CUmemGenericAllocationHandle, addr: *mut c_void) false |s| {
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(h, CUmemGenericAllocationHandle(s.retain_handle(hv(addr))?));
        Ok(())
    }
    cuMemExportToShareableHandle(sh: *mut c_void, h: CUmemGenericAllocationHandle, t: c_uint, _f: u64) false |s| {
        if sh.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(sh.cast::<c_int>(), s.export_fd(h.0, t)?);
        Ok(())
    }
    cuMemImportFromShareableHandle(h: *mut CUmemGenericAllocationHandle, os: *mut c_void, t: c_uint) false |s| {
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // A POSIX descriptor is passed as the pointer's value.
        out!(h, CUmemGenericAllocationHandle(s.import_fd(os as usize as i32, t)?));
        Ok(())
    }
    // No multicast objects here: the memory handle is checked, then the call is refused (as
    // on a GPU without NVLink multicast).
    cuMulticastBindMem(_mc: CUmemGenericAllocationHandle, _mc_offset: usize, h: CUmemGenericAllocationHandle, _offset: usize, _size: usize, _flags: u64) false |s| {
        s.handle_props(h.0)?;
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
}

exports_pt! {
    cuMemAllocAsync / cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, st: CUstream) true |s, pt| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.alloc_async(size as u64, 0, stream(st, pt))?));
        Ok(())
    }
    cuMemAllocFromPoolAsync / cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, st: CUstream) true |s, pt| {
        if dptr.is_null() || pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.alloc_async(size as u64, hv(pool), stream(st, pt))?));
        Ok(())
    }
    cuMemFreeAsync / cuMemFreeAsync_ptsz(dptr: CUdeviceptr, st: CUstream) false |s, pt| {
        s.free_async(dptr.0, stream(st, pt))
    }
}

exports! {
    cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) false |s| {
        let p: CUmemPoolProps = inp!(props);
        if p.allocType.0 != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ord = location(&p.location)?.ok_or(CUDA_ERROR_NOT_SUPPORTED)?;
        out!(pool, hp(s.pool_create(ord)?));
        Ok(())
    }
    cuMemPoolDestroy(pool: CUmemoryPool) false |s| { s.pool_destroy(hv(pool)) }
    cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) false |s| { s.pool_trim(hv(pool), keep as u64) }
    cuMemPoolGetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) false |s| {
        let v = s.pool_get_attr(hv(pool), attr.0)?;
        if attr.0 <= 3 {
            out!(value.cast::<c_int>(), v as c_int);
        } else {
            out!(value.cast::<u64>(), v);
        }
        Ok(())
    }
    cuMemPoolSetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) false |s| {
        let v = if attr.0 <= 3 { inp!(value.cast::<c_int>()) as u64 } else { inp!(value.cast::<u64>()) };
        s.pool_set_attr(hv(pool), attr.0, v)
    }
    cuMemPoolSetAccess(pool: CUmemoryPool, _desc: *const CUmemAccessDesc, _count: usize) false |s| {
        s.pool_get_attr(hv(pool), 4).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(t: u32, id: c_int) -> CuResult<Option<i32>> {
        location(&CUmemLocation {
            type_: vgpu_cuda_abi::CUmemLocationType(t),
            id,
        })
    }

    #[test]
    fn locations_follow_cuda_h() {
        assert_eq!(loc(1, 2), Ok(Some(2)), "DEVICE: id is the ordinal");
        assert_eq!(loc(2, 77), Ok(None), "HOST: id ignored");
        assert_eq!(loc(3, 0), Ok(None), "HOST_NUMA node 0");
        assert_eq!(loc(3, 1), Err(CUDA_ERROR_INVALID_VALUE), "no NUMA node 1");
        assert_eq!(loc(4, -5), Ok(None), "HOST_NUMA_CURRENT: id ignored");
        assert_eq!(loc(0, 0), Err(CUDA_ERROR_INVALID_VALUE), "INVALID");
    }
}
