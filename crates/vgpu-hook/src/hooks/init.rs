//! Initialization: `cuInit` is a list line ("forward, then ..."); this is its follow-up. (The
//! `cuGetProcAddress` follow-up hands out our exports' addresses: it is `crate::exports`'.)

use super::*;

/// `cuInit` succeeded: refuse it when enforcement could not be set up (never run unlimited).
pub(crate) fn initialized(_cuda: &Cuda) -> Result<(), CUresult> {
    match state::get() {
        Enforcement::Ready(_) => Ok(()),
        Enforcement::Broken(why) => {
            vlog!(ERROR, "cuInit refused: {why}");
            Err(CUresult::NOT_INITIALIZED)
        }
    }
}
