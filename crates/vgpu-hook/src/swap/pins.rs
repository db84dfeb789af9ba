//! Which contexts a swap-out is synchronizing, outside the swap lock, and which are ending.
//!
//! A swap-out proves every context idle by synchronizing it, which lasts as long as the
//! context's queued work (a persistent kernel: forever). It does that with the swap lock
//! released, so nothing of the program waits for it but an end of the very context being
//! synchronized: the driver forbids ending a context while another thread uses it, and
//! its own `cuCtxDestroy` waits for the same queued work anyway.
//!
//! **Invariant.** The swapper uses a context outside the swap lock only while it holds a
//! [`Pin`] of it, and pins one only while no end of it is running; an end runs only while
//! no pin of its context is held, and holds its [`Ending`] until the census has forgotten
//! the context. Both checks happen under one mutex, so a context is never pushed or
//! synchronized by the swapper while, or after, it ends (the swapper checks the census
//! after pinning). A pin covers one context at a time: ending an idle context never waits
//! for a busy one.

use std::sync::{Condvar, Mutex, MutexGuard};

use vgpu_cuda_abi::{CUcontext, CUdevice};

/// What an `ends_context` call ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ends {
    /// `cuCtxDestroy`: this context.
    Context(usize),
    /// The primary context's release or reset: the primary context of this device.
    Primary(CUdevice),
}

impl From<CUcontext> for Ends {
    fn from(ctx: CUcontext) -> Ends {
        Ends::Context(ctx as usize)
    }
}

impl From<CUdevice> for Ends {
    fn from(dev: CUdevice) -> Ends {
        Ends::Primary(dev)
    }
}

/// A context as the census knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Known {
    pub(crate) ctx: usize,
    pub(crate) device: CUdevice,
    pub(crate) primary: bool,
}

impl Ends {
    fn of(self, k: &Known) -> bool {
        match self {
            Ends::Context(c) => c == k.ctx,
            Ends::Primary(d) => k.primary && d == k.device,
        }
    }
}

#[derive(Default)]
struct Board {
    pinned: Vec<Known>,
    ending: Vec<Ends>,
}

static BOARD: Mutex<Board> = Mutex::new(Board {
    pinned: Vec::new(),
    ending: Vec::new(),
});
static CHANGED: Condvar = Condvar::new();

fn board() -> MutexGuard<'static, Board> {
    BOARD.lock().unwrap_or_else(|e| e.into_inner())
}

/// The swapper may use this context until dropped.
#[derive(Debug)]
pub(crate) struct Pin(Known);

/// Pins `k`, or `None` while an end of it runs.
pub(crate) fn pin(k: Known) -> Option<Pin> {
    let mut b = board();
    if b.ending.iter().any(|e| e.of(&k)) {
        return None;
    }
    b.pinned.push(k);
    Some(Pin(k))
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut b = board();
        if let Some(i) = b.pinned.iter().position(|k| *k == self.0) {
            b.pinned.swap_remove(i);
        }
        drop(b);
        CHANGED.notify_all();
    }
}

/// An end in progress, until dropped.
#[derive(Debug)]
pub(crate) struct Ending(Ends);

/// Waits while the swapper synchronizes the context `end` ends, then marks it ending.
pub(crate) fn ending(end: Ends) -> Ending {
    let mut b = board();
    while b.pinned.iter().any(|k| end.of(k)) {
        b = CHANGED.wait(b).unwrap_or_else(|e| e.into_inner());
    }
    b.ending.push(end);
    Ending(end)
}

impl Drop for Ending {
    fn drop(&mut self) {
        let mut b = board();
        if let Some(i) = b.ending.iter().position(|e| *e == self.0) {
            b.ending.swap_remove(i);
        }
    }
}

/// In a forked child: the parent's swapper and ends did not come along.
pub(crate) fn reset_in_child() {
    if let Ok(mut b) = BOARD.try_lock() {
        *b = Board::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    const D: CUdevice = CUdevice(7);

    fn known(ctx: usize, primary: bool) -> Known {
        Known {
            ctx,
            device: D,
            primary,
        }
    }

    #[test]
    fn an_end_waits_only_for_its_own_context_and_a_pin_never_overlaps_an_end() {
        let busy = pin(known(0x1001, true)).unwrap();
        // Another context ends at once.
        drop(ending(Ends::Context(0x1002)));
        // The pinned one (the device's primary) waits until the swapper lets go.
        let ended = Arc::new(AtomicBool::new(false));
        let e = Arc::clone(&ended);
        let t = std::thread::spawn(move || {
            let g = ending(Ends::Primary(D));
            e.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(50));
            drop(g);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!ended.load(Ordering::SeqCst), "ended while synchronized");
        drop(busy);
        while !ended.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        assert!(pin(known(0x1001, true)).is_none(), "pinned while ending");
        assert!(pin(known(0x1003, false)).is_some(), "an unrelated context");
        t.join().unwrap();
        assert!(pin(known(0x1001, true)).is_some());
    }
}
