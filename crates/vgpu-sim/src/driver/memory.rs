//! Allocations, pointer attributes, pinned host memory, IPC, copies and memsets.

use super::*;

fn write_attr(data: *mut c_void, v: PtrAttr) -> CuResult<()> {
    match v {
        PtrAttr::U32(x) => out!(data.cast::<u32>(), x),
        PtrAttr::U64(x) => out!(data.cast::<u64>(), x),
    }
    Ok(())
}

exports! {
    cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) true |s| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.mem_alloc(size as u64)?));
        Ok(())
    }
    cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) true |s| {
        if dptr.is_null() || pitch.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (p, pt) = s.mem_alloc_pitch(width as u64, height as u64, elem)?;
        out!(dptr, CUdeviceptr(p));
        out!(pitch, pt as usize);
        Ok(())
    }
    cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) true |s| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(dptr, CUdeviceptr(s.mem_alloc_managed(size as u64, flags)?));
        Ok(())
    }
    cuMemFree_v2(dptr: CUdeviceptr) false |s| { s.mem_free(dptr.0) }
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize) false |s| {
        let (f, t) = s.mem_info()?;
        out!(free, f as usize);
        out!(total, t as usize);
        Ok(())
    }
    cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) false |s| {
        let (b, n) = s.address_range(dptr.0)?;
        if !base.is_null() {
            out!(base, CUdeviceptr(b));
        }
        if !size.is_null() {
            out!(size, n as usize);
        }
        Ok(())
    }
    cuPointerGetAttribute(data: *mut c_void, attr: CUpointer_attribute, ptr: CUdeviceptr) false |s| {
        write_attr(data, s.pointer_attr(attr.0, ptr.0)?)
    }
    cuPointerGetAttributes(n: c_uint, attrs: *mut CUpointer_attribute, data: *mut *mut c_void, ptr: CUdeviceptr) false |s| {
        if attrs.is_null() || data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for i in 0..n as usize {
            // SAFETY: the caller passes arrays of `n` attributes and `n` data pointers.
            let (a, d) = unsafe { (*attrs.add(i), *data.add(i)) };
            match s.pointer_attr(a.0, ptr.0) {
                Ok(v) => write_attr(d, v)?,
                // Unknown pointers read as zeroes here, as with the real driver.
                Err(_) => match a.0 {
                    2 | 9 | 6 | 8 | 10 | 13 | 15 | 16 => out!(d.cast::<u32>(), 0),
                    _ => out!(d.cast::<u64>(), 0),
                },
            }
        }
        Ok(())
    }
    cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) false |s| {
        out!(pp, hp(s.host_alloc(size as u64, 0)?));
        Ok(())
    }
    cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) false |s| {
        out!(pp, hp(s.host_alloc(size as u64, flags)?));
        Ok(())
    }
    cuMemFreeHost(p: *mut c_void) false |s| { s.host_free(hv(p)) }
    cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) false |s| {
        out!(dptr, CUdeviceptr(s.host_device_pointer(hv(p), flags)?));
        Ok(())
    }
    cuMemHostGetFlags(pflags: *mut c_uint, p: *mut c_void) false |s| {
        out!(pflags, s.host_flags(hv(p))?);
        Ok(())
    }
    cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: c_uint) false |s| {
        // SAFETY: registering promises the range stays valid until cuMemHostUnregister (the
        // driver API's contract; the real driver pins the pages on the same trust).
        let host = unsafe { HostPtr::new(hv(p)) };
        s.host_register(host, size as u64, flags)
    }
    cuMemHostUnregister(p: *mut c_void) false |s| { s.host_unregister(hv(p)) }
    cuIpcGetMemHandle(h: *mut CUipcMemHandle, dptr: CUdeviceptr) false |s| {
        let bytes = s.ipc_handle(dptr.0)?;
        out!(h, CUipcMemHandle { reserved: bytes.map(|b| b as c_char) });
        Ok(())
    }
    cuIpcCloseMemHandle(_dptr: CUdeviceptr) false |_s| { Err(CUDA_ERROR_INVALID_VALUE) }
}

/// The simulated driver's `cuIpcOpenMemHandle_v2`: mapping another process's memory is not
/// simulated.
///
/// # Safety
/// None beyond the C ABI.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    _dptr: *mut CUdeviceptr,
    _h: CUipcMemHandle,
    _flags: c_uint,
) -> CUresult {
    entry("cuIpcOpenMemHandle_v2", false, |_| {
        Err(CUDA_ERROR_NOT_SUPPORTED)
    })
}

/// A host pointer the program passed to a copy.
fn host(p: u64) -> Addr {
    // SAFETY: the driver API makes the caller promise that a host pointer is valid for the
    // bytes the call names until the call, or the stream work it queues, completes.
    Addr::Host(unsafe { HostPtr::new(p) })
}

/// A pointer of a unified copy (`cuMemcpy`): device memory if the simulator knows it as such,
/// else the program's host memory.
fn unified(s: &Sim, p: u64) -> Addr {
    if s.is_device_ptr(p) {
        Addr::Device(p)
    } else {
        host(p)
    }
}

exports_pt! {
    cuMemcpyHtoD_v2 / cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) false |s, _pt| {
        s.memcpy(Addr::Device(dst.0), host(hv(src.cast_mut())), n as u64)
    }
    cuMemcpyDtoH_v2 / cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) false |s, _pt| {
        s.memcpy(host(hv(dst)), Addr::Device(src.0), n as u64)
    }
    cuMemcpyDtoD_v2 / cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) false |s, _pt| {
        s.memcpy(Addr::Device(dst.0), Addr::Device(src.0), n as u64)
    }
    cuMemcpy / cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) false |s, _pt| {
        s.memcpy(unified(s, dst.0), unified(s, src.0), n as u64)
    }
    cuMemsetD8_v2 / cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) false |s, _pt| {
        s.memset(dst.0, v as u32, 1, n as u64)
    }
    cuMemsetD16_v2 / cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) false |s, _pt| {
        s.memset(dst.0, v as u32, 2, n as u64)
    }
    cuMemsetD32_v2 / cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: c_uint, n: usize) false |s, _pt| {
        s.memset(dst.0, v, 4, n as u64)
    }
    cuMemcpyHtoDAsync_v2 / cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(Addr::Device(dst.0), host(hv(src.cast_mut())), n as u64, stream(st, pt))
    }
    cuMemcpyDtoHAsync_v2 / cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(host(hv(dst)), Addr::Device(src.0), n as u64, stream(st, pt))
    }
    cuMemcpyDtoDAsync_v2 / cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(Addr::Device(dst.0), Addr::Device(src.0), n as u64, stream(st, pt))
    }
    cuMemcpyAsync / cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, st: CUstream) false |s, pt| {
        s.memcpy_async(unified(s, dst.0), unified(s, src.0), n as u64, stream(st, pt))
    }
    cuMemsetD8Async / cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, st: CUstream) false |s, pt| {
        s.memset_async(dst.0, v as u32, 1, n as u64, stream(st, pt))
    }
    cuMemsetD16Async / cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, st: CUstream) false |s, pt| {
        s.memset_async(dst.0, v as u32, 2, n as u64, stream(st, pt))
    }
    cuMemsetD32Async / cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: c_uint, n: usize, st: CUstream) false |s, pt| {
        s.memset_async(dst.0, v, 4, n as u64, stream(st, pt))
    }
}
