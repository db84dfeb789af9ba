//! Streams and events.

use super::*;

exports! {
    cuStreamCreate(st: *mut CUstream, flags: c_uint) false |s| {
        out!(st, hp(s.stream_create(flags)?));
        Ok(())
    }
    cuStreamCreateWithPriority(st: *mut CUstream, flags: c_uint, _prio: c_int) false |s| {
        out!(st, hp(s.stream_create(flags)?));
        Ok(())
    }
    cuStreamDestroy_v2(st: CUstream) false |s| { s.stream_destroy(hv(st)) }
    cuStreamDestroy(st: CUstream) false |s| { s.stream_destroy(hv(st)) }
    cuEventCreate(ev: *mut CUevent, flags: c_uint) false |s| {
        out!(ev, hp(s.event_create(flags)?));
        Ok(())
    }
    cuEventDestroy_v2(ev: CUevent) false |s| { s.event_destroy(hv(ev)) }
    cuEventDestroy(ev: CUevent) false |s| { s.event_destroy(hv(ev)) }
    cuEventSynchronize(ev: CUevent) false |s| { s.event_sync(hv(ev)) }
    cuEventQuery(ev: CUevent) false |s| { s.event_query(hv(ev)) }
    cuEventElapsedTime(ms: *mut f32, a: CUevent, b: CUevent) false |s| {
        out!(ms, s.event_elapsed(hv(a), hv(b))?);
        Ok(())
    }
    cuEventElapsedTime_v2(ms: *mut f32, a: CUevent, b: CUevent) false |s| {
        out!(ms, s.event_elapsed(hv(a), hv(b))?);
        Ok(())
    }
}

exports_pt! {
    cuStreamSynchronize / cuStreamSynchronize_ptsz(st: CUstream) false |s, pt| { s.stream_sync(stream(st, pt)) }
    cuStreamQuery / cuStreamQuery_ptsz(st: CUstream) false |s, pt| { s.stream_query(stream(st, pt)) }
    cuStreamWaitEvent / cuStreamWaitEvent_ptsz(st: CUstream, ev: CUevent, _flags: c_uint) false |s, pt| {
        s.stream_wait_event(stream(st, pt), hv(ev))
    }
    cuStreamWaitValue32_v2 / cuStreamWaitValue32_v2_ptsz(st: CUstream, addr: CUdeviceptr, value: c_uint, flags: c_uint) false |s, pt| {
        s.stream_wait_value32(stream(st, pt), addr.0, value, flags)
    }
    cuStreamGetFlags / cuStreamGetFlags_ptsz(st: CUstream, flags: *mut c_uint) false |s, _pt| {
        out!(flags, s.stream_flags(hv(st))?);
        Ok(())
    }
    cuStreamGetPriority / cuStreamGetPriority_ptsz(st: CUstream, prio: *mut c_int) false |s, _pt| {
        s.stream_flags(hv(st))?;
        out!(prio, 0);
        Ok(())
    }
    cuStreamGetCtx / cuStreamGetCtx_ptsz(st: CUstream, pctx: *mut CUcontext) false |s, _pt| {
        let ctx = match crate::state::unhandle(tag::STREAM, hv(st)) {
            None => s.current()?,
            Some(_) => {
                s.stream_flags(hv(st))?;
                s.current()?
            }
        };
        out!(pctx, hp(handle(tag::CTX, ctx)));
        Ok(())
    }
    cuEventRecord / cuEventRecord_ptsz(ev: CUevent, st: CUstream) false |s, pt| { s.event_record(hv(ev), stream(st, pt)) }
    cuEventRecordWithFlags / cuEventRecordWithFlags_ptsz(ev: CUevent, st: CUstream, _flags: c_uint) false |s, pt| {
        s.event_record(hv(ev), stream(st, pt))
    }
    cuStreamBeginCapture_v2 / cuStreamBeginCapture_v2_ptsz(st: CUstream, mode: c_uint) false |s, _pt| {
        s.begin_capture(hv(st), mode)
    }
    cuStreamBeginCapture / cuStreamBeginCapture_ptsz(st: CUstream) false |s, _pt| { s.begin_capture(hv(st), 0) }
    cuStreamEndCapture / cuStreamEndCapture_ptsz(st: CUstream, graph: *mut CUgraph) false |s, _pt| {
        if graph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(graph, hp(s.end_capture(hv(st))?));
        Ok(())
    }
    cuStreamIsCapturing / cuStreamIsCapturing_ptsz(st: CUstream, status: *mut c_uint) false |s, _pt| {
        out!(status, s.is_capturing(hv(st))?);
        Ok(())
    }
    cuStreamGetCaptureInfo_v2 / cuStreamGetCaptureInfo_v2_ptsz(st: CUstream, status: *mut c_uint, id: *mut u64, graph: *mut CUgraph, deps: *mut *const CUgraphNode, ndeps: *mut usize) false |s, _pt| {
        out!(status, s.is_capturing(hv(st))?);
        if !id.is_null() {
            out!(id, hv(st));
        }
        if !graph.is_null() {
            out!(graph, std::ptr::null_mut());
        }
        if !deps.is_null() {
            out!(deps, std::ptr::null());
        }
        if !ndeps.is_null() {
            out!(ndeps, 0);
        }
        Ok(())
    }
}
