//! Sync points: pools give memory back to the device here. Every sync hook is a list line
//! ("forward, finally `after_sync`").

use super::*;

/// `cuCtxSynchronize`: a sync point; once the context's work is finished, its host-backed
/// allocations move back onto its device while room allows, if it is the device's only
/// context (docs/oversubscription.md: this is the one place a move happens, since then no
/// work can be using them).
pub(crate) fn cuCtxSynchronize(forward: impl Forward) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let answer = forward(cuda);
    after_sync(cuda);
    if answer.is_ok() {
        move_back_on_current(cuda);
    }
    answer
}

/// `cuCtxSynchronize_v2` (CUDA 13; the runtime's `cudaDeviceSynchronize` may use it): the same
/// sync point when it synchronizes the current context (NULL names it too). The move works on
/// the current context, so another context's synchronization moves nothing.
pub(crate) fn cuCtxSynchronize_v2(forward: impl Forward, ctx: CUcontext) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    let answer = forward(cuda);
    after_sync(cuda);
    let current = ctx.is_null() || driver::current_context(cuda).is_ok_and(|c| c == ctx);
    if answer.is_ok() && current {
        move_back_on_current(cuda);
    }
    answer
}

/// Host-backed allocations of the current context, just synchronized, move back while room
/// allows.
fn move_back_on_current(cuda: &Cuda) {
    if let Some(st) = ready_state().filter(|st| st.host_backed.any()) {
        if let Ok((ctx, dev)) = driver::current(cuda) {
            let reserve = st.config.host_backing.device_reserve;
            st.host_backed
                .move_back(cuda, st.ledger(), (dev, ctx), reserve);
        }
    }
}

/// After a sync point, whatever it answered: pools may have given memory back; after a
/// pool grew, the driver's own memory for it is reconciled once more (it may take some
/// after the allocation returned).
pub(crate) fn after_sync(cuda: &Cuda) {
    if let Some(st) = ready_state() {
        if st.pools.is_active() {
            settle_all_pools(st, cuda);
        }
        if st.pool_grew.load(Ordering::Relaxed) && st.pool_grew.swap(false, Ordering::Relaxed) {
            let _ = reconcile_all(st, cuda, OverLimit::Charge);
        }
    }
}
