//! The contexts this process holds on each device, as the hook saw them made and destroyed:
//! what the move rule needs to know which contexts can reach a host-backed allocation
//! (docs/oversubscription.md, "When a move is safe").
//!
//! A host-backed allocation is VMM memory whose access is granted to its device, not to a
//! context: every context of the process on that device can reach it. A context's
//! synchronize proves only that context idle, and the driver has no call that says another
//! context is idle without waiting for it (waiting inside the program's synchronize for work
//! it did not ask to wait for could hang it, when that work waits on the host). So a move
//! happens only at the synchronize of the device's one context.
//!
//! Every way a program makes a context reaches the hook (`cuCtxCreate` in each version and
//! `cuDevicePrimaryCtxRetain`, linked, through `dlsym` or through `cuGetProcAddress`), so the
//! census is complete for those; a context the census does not know (made some other way)
//! never allows a move.

use std::sync::Mutex;

use vgpu_cuda_abi::CUdevice;

use crate::swap::pins::Known;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    ctx: usize,
    device: CUdevice,
    primary: bool,
}

/// The live contexts of this process, per device.
#[derive(Debug, Default)]
pub(crate) struct DeviceContexts {
    live: Mutex<Vec<Seen>>,
}

impl DeviceContexts {
    fn live(&self) -> std::sync::MutexGuard<'_, Vec<Seen>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, seen: Seen) {
        let mut live = self.live();
        if !live.contains(&seen) {
            live.push(seen);
        }
    }

    /// `cuCtxCreate` made `ctx` on `device`.
    pub(crate) fn created(&self, ctx: usize, device: CUdevice) {
        self.add(Seen {
            ctx,
            device,
            primary: false,
        });
    }

    /// `cuDevicePrimaryCtxRetain` answered `ctx` for `device` (the same one while it lives).
    pub(crate) fn primary_retained(&self, ctx: usize, device: CUdevice) {
        self.add(Seen {
            ctx,
            device,
            primary: true,
        });
    }

    /// `cuCtxDestroy` destroyed `ctx`.
    pub(crate) fn destroyed(&self, ctx: usize) {
        self.live().retain(|s| s.ctx != ctx);
    }

    /// The primary context of `device` is gone (its last release, or a reset that destroyed
    /// it).
    pub(crate) fn primary_gone(&self, device: CUdevice) {
        self.live().retain(|s| !(s.primary && s.device == device));
    }

    /// The live contexts of `device`, as the swapper pins them.
    pub(crate) fn known_on(&self, device: CUdevice) -> Vec<Known> {
        self.live()
            .iter()
            .filter(|s| s.device == device)
            .map(|s| Known {
                ctx: s.ctx,
                device: s.device,
                primary: s.primary,
            })
            .collect()
    }

    /// Whether `k` is still alive.
    pub(crate) fn lives(&self, k: Known) -> bool {
        self.live()
            .iter()
            .any(|s| s.ctx == k.ctx && s.device == k.device && s.primary == k.primary)
    }

    /// Whether `ctx` is a context of `device` this process made and the only one there.
    pub(crate) fn alone_on(&self, ctx: usize, device: CUdevice) -> bool {
        let live = self.live();
        let mut on_device = live.iter().filter(|s| s.device == device);
        matches!((on_device.next(), on_device.next()), (Some(s), None) if s.ctx == ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D0: CUdevice = CUdevice(0);
    const D1: CUdevice = CUdevice(1);

    #[test]
    fn a_context_is_alone_only_when_no_other_lives_on_its_device() {
        let c = DeviceContexts::default();
        assert!(!c.alone_on(0xa, D0), "an unknown context never is");
        c.primary_retained(0xa, D0);
        c.primary_retained(0xa, D0); // retained again: the same context
        assert!(c.alone_on(0xa, D0));
        c.created(0xb, D1);
        assert!(
            c.alone_on(0xa, D0),
            "a context of another device does not count"
        );
        c.created(0xc, D0);
        assert!(!c.alone_on(0xa, D0) && !c.alone_on(0xc, D0));
        c.primary_gone(D0);
        assert!(c.alone_on(0xc, D0));
        c.destroyed(0xc);
        assert!(!c.alone_on(0xc, D0));
        assert!(c.alone_on(0xb, D1));
    }
}
