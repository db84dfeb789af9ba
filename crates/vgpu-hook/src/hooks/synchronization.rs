//! Sync points: pools give memory back to the device here.

use super::*;

/// After a sync point: pools and graph memory may have given memory back.
pub(super) fn after_sync(cuda: &Cuda) {
    if let Some(st) = ready_state() {
        if st.pools.is_active() {
            settle_all_pools(st, cuda);
        }
    }
}

pub(crate) unsafe fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuStreamSynchronize(stream));
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuStreamSynchronize_ptsz(stream));
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuCtxSynchronize() -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuCtxSynchronize());
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuCtxSynchronize_v2(ctx));
    after_sync(cuda);
    r
}

pub(crate) unsafe fn cuEventSynchronize(event: CUevent) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuEventSynchronize(event));
    after_sync(cuda);
    r
}
