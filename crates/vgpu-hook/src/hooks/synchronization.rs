//! Sync points: pools give memory back to the device here. Every sync hook is a list line
//! ("forward, finally `after_sync`").

use super::*;

/// After a sync point, whatever it answered: pools may have given memory back.
pub(crate) fn after_sync(cuda: &Cuda) {
    if let Some(st) = ready_state() {
        if st.pools.is_active() {
            settle_all_pools(st, cuda);
        }
    }
}
