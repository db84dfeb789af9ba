//! Modules, libraries, functions and kernel launches.

use super::*;

/// A library handle is its module's handle with the top bit set, so that the two kinds are
/// told apart (a module handle passed as a library is `CUDA_ERROR_INVALID_HANDLE`).
const LIBRARY_BIT: u64 = 1 << 63;

fn library_of(module: u64) -> u64 {
    module | LIBRARY_BIT
}

fn module_of(library: u64) -> CuResult<u64> {
    if library & LIBRARY_BIT == 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(library & !LIBRARY_BIT)
}

fn load_image(s: &Sim, image: *const c_void) -> CuResult<u64> {
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: module images are NUL-terminated text for the simulator (the real driver also
    // takes PTX as a C string); a non-text image is rejected after reading its first bytes.
    let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) };
    s.module_load(text.to_bytes())
}

/// Packs kernel arguments from `kernelParams` (one pointer per parameter) or from `extra`
/// (`CU_LAUNCH_PARAM_BUFFER_POINTER`/`_SIZE`).
pub(super) fn pack_args(
    k: Kernel,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<Vec<u8>> {
    let sizes = k.param_sizes();
    let mut out = Vec::with_capacity(20);
    if !params.is_null() {
        for (i, &n) in sizes.iter().enumerate() {
            // SAFETY: the driver API requires `kernelParams` to hold one valid pointer per
            // kernel parameter, each pointing at a value of that parameter's size.
            let arg = unsafe { *params.add(i) };
            if arg.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: as above.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(arg.cast::<u8>(), n) });
        }
        return Ok(out);
    }
    if !extra.is_null() {
        let (mut buf, mut size) = (std::ptr::null::<u8>(), 0usize);
        let mut i = 0;
        loop {
            // SAFETY: `extra` is a key/value list ending in CU_LAUNCH_PARAM_END (0).
            let key = unsafe { *extra.add(i) } as usize;
            match key {
                0 => break,
                // SAFETY: BUFFER_POINTER and BUFFER_SIZE are followed by their value.
                1 => buf = unsafe { *extra.add(i + 1) }.cast::<u8>(),
                // SAFETY: BUFFER_SIZE's value points at a size_t.
                2 => size = unsafe { *(*extra.add(i + 1)).cast::<usize>() },
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
            i += 2;
        }
        let mut off = 0usize;
        for &n in sizes {
            off = off.div_ceil(n) * n;
            if buf.is_null() || off + n > size {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: `buf` holds `size` bytes of packed arguments; checked above.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(buf.add(off), n) });
            off += n;
        }
        return Ok(out);
    }
    if sizes.is_empty() {
        Ok(out)
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

fn launch(
    s: &'static Sim,
    f: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    stream: StreamArg,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
) -> CuResult<()> {
    // Under lazy loading a function's first launch in its context waits for the context.
    let (kernel, dev) = s.function_for_launch_call(hv(f))?;
    s.check_dims(grid, block, cooperative)?;
    let args = pack_args(kernel, params, extra)?;
    s.launch(
        Launch {
            kernel,
            dev,
            grid,
            block,
            args,
        },
        stream,
    )
}

exports! {
    cuModuleLoadData(m: *mut CUmodule, image: *const c_void) false |s| {
        if m.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(m, hp(load_image(s, image)?));
        Ok(())
    }
    cuModuleLoadDataEx(m: *mut CUmodule, image: *const c_void, _n: c_uint, _opts: *mut c_uint, _vals: *mut *mut c_void) false |s| {
        if m.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(m, hp(load_image(s, image)?));
        Ok(())
    }
    cuModuleLoadFatBinary(m: *mut CUmodule, image: *const c_void) false |s| {
        if m.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(m, hp(load_image(s, image)?));
        Ok(())
    }
    cuModuleLoad(m: *mut CUmodule, path: *const c_char) false |s| {
        let path = cstr!(path);
        let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        out!(m, hp(s.module_load(&bytes[..end])?));
        Ok(())
    }
    cuModuleUnload(m: CUmodule) false |s| { s.module_unload(hv(m)) }
    // Libraries are modules of the current context here (the real driver loads them into
    // every context, context-independently).
    cuLibraryLoadData(l: *mut CUmodule, code: *const c_void, _jo: *mut c_uint, _jv: *mut *mut c_void, _njo: c_uint, _lo: *mut c_uint, _lv: *mut *mut c_void, _nlo: c_uint) false |s| {
        if l.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(l, hp(library_of(load_image(s, code)?)));
        Ok(())
    }
    cuLibraryLoadFromFile(l: *mut CUmodule, path: *const c_char, _jo: *mut c_uint, _jv: *mut *mut c_void, _njo: c_uint, _lo: *mut c_uint, _lv: *mut *mut c_void, _nlo: c_uint) false |s| {
        if l.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let path = cstr!(path);
        let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        out!(l, hp(library_of(s.module_load(&bytes[..end])?)));
        Ok(())
    }
    cuLibraryUnload(l: CUmodule) false |s| { s.module_unload(module_of(hv(l))?) }
    cuLibraryGetModule(m: *mut CUmodule, l: CUmodule) false |s| {
        let module = module_of(hv(l))?;
        s.module_check(module)?;
        out!(m, hp(module));
        Ok(())
    }
    cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) false |s| {
        let name = cstr!(name);
        out!(f, hp(s.get_function(hv(m), name)?));
        Ok(())
    }
    cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: CUfunction) false |s| {
        s.function(hv(f))?;
        out!(v, match attr { 0 => 1024, 4 => 32, _ => 0 });
        Ok(())
    }
    cuFuncSetAttribute(f: CUfunction, _attr: c_int, _v: c_int) false |s| { s.function(hv(f)).map(|_| ()) }
    cuFuncSetCacheConfig(f: CUfunction, _c: c_uint) false |s| { s.function(hv(f)).map(|_| ()) }
    cuOccupancyMaxActiveBlocksPerMultiprocessor(n: *mut c_int, f: CUfunction, block: c_int, _smem: usize) false |s| {
        s.function(hv(f))?;
        out!(n, (2048 / block.max(1)).clamp(1, 32));
        Ok(())
    }
}

exports_pt! {
    cuLaunchKernel / cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, st: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) false |s, pt| {
        launch(s, f, [gx, gy, gz], [bx, by, bz], stream(st, pt), params, extra, false)
    }
    cuLaunchCooperativeKernel / cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, st: CUstream, params: *mut *mut c_void) false |s, pt| {
        launch(s, f, [gx, gy, gz], [bx, by, bz], stream(st, pt), params, std::ptr::null_mut(), true)
    }
    cuLaunchKernelEx / cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) false |s, pt| {
        let c: CUlaunchConfig = inp!(config);
        launch(
            s,
            f,
            [c.gridDimX, c.gridDimY, c.gridDimZ],
            [c.blockDimX, c.blockDimY, c.blockDimZ],
            stream(c.hStream, pt),
            params,
            extra,
            false,
        )
    }
    cuGraphLaunch / cuGraphLaunch_ptsz(exec: CUgraphExec, st: CUstream) false |s, pt| {
        s.graph_launch(hv(exec), stream(st, pt))
    }
    cuGraphUpload / cuGraphUpload_ptsz(exec: CUgraphExec, st: CUstream) true |s, pt| {
        s.graph_upload(hv(exec), stream(st, pt))
    }
}
