//! Sync points: pools give memory back to the device here. Every sync hook is a list line
//! ("forward, finally `after_sync`").

use super::*;

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
