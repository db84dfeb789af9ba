//! Contexts: primary, created, current, synchronization, limits.

use super::*;

exports! {
    cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) true |s| {
        out_created!(pctx, hp(handle(tag::CTX, s.primary_retain(dev.0)?)));
        Ok(())
    }
    cuDevicePrimaryCtxRelease(dev: CUdevice) false |s| { s.primary_release(dev.0) }
    cuDevicePrimaryCtxRelease_v2(dev: CUdevice) false |s| { s.primary_release(dev.0) }
    cuDevicePrimaryCtxReset(dev: CUdevice) false |s| { s.primary_reset(dev.0) }
    cuDevicePrimaryCtxReset_v2(dev: CUdevice) false |s| { s.primary_reset(dev.0) }
    cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) false |s| {
        let (f, a) = s.primary_state(dev.0)?;
        out!(flags, f);
        out!(active, a as c_int);
        Ok(())
    }
    cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) false |s| { s.primary_set_flags(dev.0, flags) }
    cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) false |s| { s.primary_set_flags(dev.0, flags) }
    cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) true |s| {
        out_created!(pctx, hp(handle(tag::CTX, s.ctx_create(flags, dev.0)?)));
        Ok(())
    }
    cuCtxCreate_v3(pctx: *mut CUcontext, _params: *mut c_void, _n: c_int, flags: c_uint, dev: CUdevice) true |s| {
        out_created!(pctx, hp(handle(tag::CTX, s.ctx_create(flags, dev.0)?)));
        Ok(())
    }
    cuCtxCreate_v4(pctx: *mut CUcontext, _params: *mut c_void, flags: c_uint, dev: CUdevice) true |s| {
        out_created!(pctx, hp(handle(tag::CTX, s.ctx_create(flags, dev.0)?)));
        Ok(())
    }
    cuCtxDestroy(ctx: CUcontext) false |s| { ctx_destroy(s, ctx) }
    cuCtxDestroy_v2(ctx: CUcontext) false |s| { ctx_destroy(s, ctx) }
    cuCtxGetCurrent(pctx: *mut CUcontext) false |s| {
        out!(pctx, hp(match s.current_or_null() { 0 => 0, id => handle(tag::CTX, id) }));
        Ok(())
    }
    cuCtxSetCurrent(ctx: CUcontext) false |s| {
        let id = if ctx.is_null() { 0 } else { ctx_id(ctx)? };
        s.set_current(id)
    }
    cuCtxPushCurrent_v2(ctx: CUcontext) false |s| { s.push(ctx_id(ctx)?) }
    cuCtxPopCurrent_v2(pctx: *mut CUcontext) false |s| {
        let id = s.pop()?;
        if !pctx.is_null() {
            out!(pctx, hp(handle(tag::CTX, id)));
        }
        Ok(())
    }
    cuCtxGetDevice(dev: *mut CUdevice) false |s| {
        out!(dev, CUdevice(s.ctx_info(0)?.0));
        Ok(())
    }
    cuCtxGetDevice_v2(dev: *mut CUdevice, ctx: CUcontext) false |s| {
        let id = if ctx.is_null() { 0 } else { ctx_id(ctx)? };
        out!(dev, CUdevice(s.ctx_info(id)?.0));
        Ok(())
    }
    cuCtxGetFlags(flags: *mut c_uint) false |s| {
        out!(flags, s.ctx_info(0)?.1);
        Ok(())
    }
    cuCtxGetId(ctx: CUcontext, id: *mut u64) false |s| {
        let c = if ctx.is_null() { s.current()? } else { ctx_id(ctx)? };
        out!(id, c);
        Ok(())
    }
    cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) false |s| {
        if !ctx.is_null() {
            s.ctx_info(ctx_id(ctx)?)?;
        }
        out!(version, 12000);
        Ok(())
    }
    cuCtxSynchronize() false |s| { s.ctx_sync(0) }
    cuCtxSynchronize_v2(ctx: CUcontext) false |s| {
        s.ctx_sync(if ctx.is_null() { 0 } else { ctx_id(ctx)? })
    }
    cuCtxSetLimit(limit: c_uint, value: usize) false |s| {
        s.ctx_limit(limit, Some(value as u64)).map(|_| ())
    }
    cuCtxGetLimit(value: *mut usize, limit: c_uint) false |s| {
        out!(value, s.ctx_limit(limit, None)? as usize);
        Ok(())
    }
    cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) false |s| {
        s.current()?;
        if !least.is_null() {
            out!(least, 0);
        }
        if !greatest.is_null() {
            out!(greatest, -5);
        }
        Ok(())
    }
    cuCtxGetCacheConfig(config: *mut c_uint) false |s| {
        s.current()?;
        out!(config, 0);
        Ok(())
    }
    cuCtxSetCacheConfig(_config: c_uint) false |s| { s.current().map(|_| ()) }
}

fn ctx_id(ctx: CUcontext) -> CuResult<u64> {
    crate::state::unhandle(tag::CTX, hv(ctx)).ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

fn ctx_destroy(s: &Sim, ctx: CUcontext) -> CuResult<()> {
    s.ctx_destroy(ctx_id(ctx)?)
}
