//! Swapping the allocations that can move (docs/swap.md): every device-resident allocation
//! this module made goes to host memory at its own address, and comes back on the next call
//! that can touch device memory. The caller (`crate::swap`) has established the move rule for
//! the whole process first: the gate is closed, no gated call runs, every context is idle.
//!
//! A swap-out of one allocation is [`move_one`] the other way round: host bytes charged
//! first (no bound: the bytes only change class), a host-located allocation filled through a
//! second address, the allocation's own address remapped to it, the device allocation and
//! its data charge released last, so the memory returns to the node. A failure at any step
//! leaves the allocation on the device, mapped and intact.

use std::sync::atomic::Ordering;

use vgpu_alloc_core::{OutOfMemory, UsageClass, UsageLedger};
use vgpu_cuda_abi::*;

use vgpu_alloc_core::DeviceIndex;

use super::{
    Backed, HostBacked, Place, create_on_host, device_location, granularity, host_location,
    map_fresh, move_one, rehome, round_up, staged,
};
use crate::driver;
use crate::ledger::SharedLedger;
use crate::log::{INFO, WARN, vlog};
use crate::real::Cuda;

/// The contexts whose allocations a swap touches, each once.
pub(crate) type Contexts = Vec<(CUcontext, CUdevice)>;

/// What a swap-out would move.
#[derive(Debug, Default)]
pub(crate) struct Swappable {
    /// Device-resident bytes.
    pub(crate) bytes: u64,
    /// Of them, those with no host memory kept from an earlier swap-in: what must be pinned.
    pub(crate) to_pin: u64,
    /// The contexts they belong to, each once.
    pub(crate) contexts: Contexts,
}

/// What a swap-out moved.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Moved {
    /// Bytes now in host memory.
    pub(crate) bytes: u64,
    /// Of them, those copied into host memory pinned for the occasion (the slow part), not
    /// into memory kept or pinned ahead.
    pub(crate) pinned_afresh: u64,
    /// Of them, those staged in pageable memory (no pinned memory was at hand).
    pub(crate) staged: u64,
}

/// What a swap-in left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SwapIn {
    /// Everything swapped out is back on its device.
    Done,
    /// Some allocations found no room yet (bytes still out).
    Short(u64),
}

/// Runs `f` with `ctx` current on this thread, then puts the thread's context back.
pub(crate) fn in_context<R>(
    cuda: &Cuda,
    ctx: CUcontext,
    f: impl FnOnce() -> Result<R, CUresult>,
) -> Result<R, CUresult> {
    driver::push_context(cuda, ctx)?;
    let r = f();
    let _ = driver::pop_context(cuda);
    r
}

impl HostBacked {
    /// A program's `cuMemAlloc` of `bytes` made movable (`VGPU_SWAP_MOVABLE`): a reserved
    /// address range mapped to a device-located allocation of the hook's, charged as data on
    /// `device`, so that a swap-out can remap the address to host memory. `Err` leaves
    /// nothing behind (the caller then allocates as usual; the limit's refusal included,
    /// which the usual path reports).
    pub(crate) fn allocate_movable(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        device: DeviceIndex,
        (ordinal, context): (CUdevice, CUcontext),
        bytes: u64,
    ) -> Result<CUdeviceptr, CUresult> {
        let prop = driver::pinned_prop(device_location(ordinal));
        let gran = granularity(cuda, &prop);
        let size = round_up(bytes.max(1), gran).ok_or(CUresult::OUT_OF_MEMORY)?;
        ledger
            .try_reserve(device, UsageClass::Data, size)
            .map_err(|_: OutOfMemory| CUresult::OUT_OF_MEMORY)?;
        let (va, handle) = match map_fresh(cuda, size, gran, ordinal, || {
            driver::mem_create(cuda, size, &prop)
        }) {
            Ok(m) => m,
            Err(failed) => {
                ledger.release(device, UsageClass::Data, size);
                return Err(failed.code());
            }
        };
        self.adopt(va, device, (ordinal, context), size, handle, Place::Device);
        Ok(va)
    }

    /// What a swap-out would move now.
    pub(crate) fn swappable(&self) -> Swappable {
        let entries = self.lock();
        let mut s = Swappable::default();
        for e in entries.values().filter(|e| e.place == Place::Device) {
            s.bytes = s.bytes.saturating_add(e.size);
            if e.spare.is_none() {
                s.to_pin = s.to_pin.saturating_add(e.size);
            }
            let c = (e.context as CUcontext, e.ordinal);
            if !s.contexts.contains(&c) {
                s.contexts.push(c);
            }
        }
        self.program.swappable(&mut s);
        s
    }

    /// Pins host memory ahead of a swap-out for the largest device-resident allocation that
    /// has none kept: created with no lock held (about 0.3 s per GiB on the H200), then kept
    /// with the allocation if that is still there and still without. The bytes pinned, `None`
    /// if there was nothing to do or the pinning failed.
    pub(crate) fn pin_ahead(&self, cuda: &Cuda, ledger: &SharedLedger) -> Option<u64> {
        let (va, size, handle, ctx) = {
            let entries = self.lock();
            let Some((&va, e)) = entries
                .iter()
                .filter(|(_, e)| e.place == Place::Device && e.spare.is_none())
                .max_by_key(|(_, e)| e.size)
            else {
                // The hook's own are done: the program's handles next.
                drop(entries);
                return self.program.pin_ahead(cuda, ledger, &self.contexts);
            };
            (va, e.size, e.handle, e.context)
        };
        let pinned = in_context(cuda, ctx as CUcontext, || {
            create_on_host(cuda, size, 0, &|| false)
        })
        .ok()?;
        let mut entries = self.lock();
        match entries.get_mut(&va) {
            // A spare is exactly its allocation's size (a swap-out maps it in its place): an
            // allocation freed meanwhile and another made at the address does not take it.
            Some(e)
                if e.handle == handle
                    && e.size == size
                    && e.place == Place::Device
                    && e.spare.is_none() =>
            {
                e.spare.keep(cuda, ledger, pinned, size);
                Some(size)
            }
            _ => {
                drop(entries);
                let _ = driver::mem_release(cuda, pinned);
                Some(0)
            }
        }
    }

    /// Moves every device-resident allocation to host memory at its address; an allocation
    /// that could not move stays on the device, intact (said in the log). `progress` runs
    /// after each allocation (the giver's offer stays fresh while the move takes long).
    pub(crate) fn swap_out(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        progress: &mut dyn FnMut(),
    ) -> Moved {
        let mut entries = self.lock();
        let mut moved = Moved::default();
        // A new swap-out: pinning for what it stages may be tried again.
        self.staging_refused.store(false, Ordering::Relaxed);
        for (&va, e) in entries.iter_mut().filter(|(_, e)| e.place == Place::Device) {
            let ctx = e.context as CUcontext;
            match in_context(cuda, ctx, || move_out(cuda, ledger, CUdeviceptr(va), e)) {
                Ok(how) => {
                    self.on_host.fetch_add(1, Ordering::Release);
                    moved.bytes += e.size;
                    match how {
                        Out::Kept => {}
                        Out::PinnedAfresh => moved.pinned_afresh += e.size,
                        Out::Staged => {
                            self.staged.fetch_add(1, Ordering::Release);
                            moved.staged += e.size;
                        }
                    }
                }
                Err(code) => vlog!(
                    WARN,
                    "swapping out {} bytes at {va:#x} failed (error {}); they stay on device {}",
                    e.size,
                    code.0,
                    e.device.0
                ),
            }
            progress();
        }
        drop(entries);
        self.program
            .swap_out(cuda, ledger, &self.contexts, &mut moved, progress);
        moved
    }

    /// Brings back every swapped-out allocation that has room now (the limit's headroom and
    /// the GPU's free memory less `device_reserve`), largest first; `keep_host`: each keeps
    /// the host memory it leaves for its next swap-out.
    pub(crate) fn swap_in(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        device_reserve: u64,
        keep_host: bool,
    ) -> SwapIn {
        let mut entries = self.lock();
        let mut keys: Vec<(u64, u64)> = entries
            .iter()
            .filter(|(_, e)| e.swapped)
            .map(|(&va, e)| (va, e.size))
            .collect();
        keys.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut short = 0u64;
        for (va, _) in keys {
            let Some(e) = entries.get_mut(&va) else {
                continue;
            };
            let ctx = e.context as CUcontext;
            let back = in_context(cuda, ctx, || {
                let (free, _) = driver::mem_get_info(cuda)?;
                if free.saturating_sub(device_reserve) < e.size {
                    return Err(CUresult::OUT_OF_MEMORY);
                }
                if e.staged.is_some() {
                    return staged::stage_in(cuda, ledger, CUdeviceptr(va), e).map(|()| None);
                }
                move_one(cuda, ledger, CUdeviceptr(va), e).map(Some)
            });
            match back {
                Ok(None) => {
                    // From pageable memory: nothing emptied to keep (a spare pinned for it
                    // meanwhile stays).
                    self.staged.fetch_sub(1, Ordering::Release);
                    e.swapped = false;
                    self.on_host.fetch_sub(1, Ordering::Release);
                    vlog!(
                        INFO,
                        "{} bytes at {va:#x} swapped back in from pageable memory",
                        e.size
                    );
                }
                Ok(Some(emptied)) => {
                    // Kept, its next swap-out copies at link speed instead of pinning afresh.
                    if keep_host {
                        e.spare.keep(cuda, ledger, emptied, e.size);
                    } else {
                        let _ = driver::mem_release(cuda, emptied);
                    }
                    e.swapped = false;
                    self.on_host.fetch_sub(1, Ordering::Release);
                    vlog!(INFO, "{} bytes at {va:#x} swapped back in", e.size);
                }
                Err(_) => short += e.size,
            }
        }
        drop(entries);
        short += self
            .program
            .swap_in(cuda, ledger, &self.contexts, (device_reserve, keep_host));
        if short == 0 {
            SwapIn::Done
        } else {
            SwapIn::Short(short)
        }
    }
}

/// Where a swap-out put one allocation's bytes.
enum Out {
    /// Into pinned memory kept for it (from its last swap-in, or pinned ahead).
    Kept,
    /// Into pinned memory created for it now.
    PinnedAfresh,
    /// Into pageable memory: none was pinned for it (docs/swap.md, "Pageable staging").
    Staged,
}

/// One swap-out: with no pinned memory kept for it, staged in pageable memory; else (or where
/// no pageable memory can be had) host bytes charged, a host-located allocation filled
/// through a second address, the allocation's own address remapped to it, the device memory
/// and its charge released last.
fn move_out(
    cuda: &Cuda,
    ledger: &SharedLedger,
    va: CUdeviceptr,
    e: &mut Backed,
) -> Result<Out, CUresult> {
    let kept = !e.spare.is_none();
    if !kept && staged::stage_out(cuda, ledger, va, e)? {
        return Ok(Out::Staged);
    }
    let host_handle = e.spare.host_for_move_out(cuda, ledger, e.device, e.size)?;
    let undo_charge = || ledger.release_host(e.device, e.size);
    let prop = driver::pinned_prop(host_location());
    if let Err(code) = rehome(cuda, va, e, host_handle, &prop) {
        undo_charge();
        return Err(code);
    }
    let _ = driver::mem_release(cuda, e.handle);
    ledger.release(e.device, UsageClass::Data, e.size);
    e.handle = host_handle;
    e.place = Place::Host;
    e.swapped = true;
    Ok(if kept { Out::Kept } else { Out::PinnedAfresh })
}
