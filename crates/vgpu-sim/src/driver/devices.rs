//! Devices: count, names, UUIDs, memory, attributes.

use super::*;

fn name_into(buf: *mut c_char, len: c_int, text: &str) -> CuResult<()> {
    if buf.is_null() || len <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: the caller gave a buffer of `len` bytes; we write at most `len` (text + NUL).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    Ok(())
}

fn uuid_of(s: &Sim, dev: CUdevice) -> CuResult<CUuuid> {
    let p = s.phys(dev.0)?;
    Ok(CUuuid {
        bytes: s.devices[p].uuid.map(|b| b as c_char),
    })
}

exports! {
    cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) false |s| {
        s.phys(ordinal)?;
        out!(dev, CUdevice(ordinal));
        Ok(())
    }
    cuDeviceGetCount(count: *mut c_int) false |s| {
        out!(count, s.device_count() as c_int);
        Ok(())
    }
    cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) false |s| {
        s.phys(dev.0)?;
        name_into(name, len, &s.cfg.name)
    }
    cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) false |s| {
        out!(uuid, uuid_of(s, dev)?);
        Ok(())
    }
    cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) false |s| {
        out!(uuid, uuid_of(s, dev)?);
        Ok(())
    }
    cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) false |s| {
        let p = s.phys(dev.0)?;
        out!(bytes, s.devices[p].total as usize);
        Ok(())
    }
    cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) false |s| {
        let p = s.phys(dev.0)?;
        out!(bytes, s.devices[p].total.min(u32::MAX as u64) as c_uint);
        Ok(())
    }
    cuDeviceGetAttribute(value: *mut c_int, attr: c_int, dev: CUdevice) false |s| {
        out!(value, s.attribute(attr, dev.0)?);
        Ok(())
    }
    cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) false |s| {
        s.phys(dev.0)?;
        out!(major, s.cfg.compute_capability.0);
        out!(minor, s.cfg.compute_capability.1);
        Ok(())
    }
    cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: CUdevice) false |s| {
        let p = s.phys(dev.0)?;
        name_into(bus, len, &format!("00000000:{:02X}:00.0", p + 1))
    }
    cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus: *const c_char) false |s| {
        let text = cstr!(bus).to_ascii_uppercase();
        let p = (0..s.devices.len())
            .find(|p| text.ends_with(&format!("{:02X}:00.0", p + 1)))
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        out!(dev, CUdevice(s.ordinal_of(p).ok_or(CUDA_ERROR_INVALID_DEVICE)?));
        Ok(())
    }
    cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) false |s| {
        out!(pool, hp(s.default_pool(dev.0)?));
        Ok(())
    }
    cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) false |s| {
        out!(pool, hp(s.current_pool(dev.0)?));
        Ok(())
    }
    cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) false |s| {
        s.set_current_pool(dev.0, hv(pool))
    }
    cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: CUgraphMem_attribute, value: *mut c_void) false |s| {
        out!(value.cast::<u64>(), s.graph_mem_attr(dev.0, attr.0)?);
        Ok(())
    }
    cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: CUgraphMem_attribute, _value: *mut c_void) false |s| {
        s.graph_mem_attr(dev.0, attr.0)?;
        Ok(())
    }
    cuDeviceGraphMemTrim(dev: CUdevice) false |s| {
        s.graph_mem_trim(dev.0)
    }
}
