//! Pageable staging (docs/swap.md, "Pageable staging"): a swap-out that finds no pinned host
//! memory for an allocation copies its bytes into pageable memory of the process and releases
//! its device memory at once, leaving its address reserved and mapping nothing (sound because
//! every call that could touch it swaps the process in first: the gate). While the process
//! stays out, the `vgpu-swap` thread pins host memory for it (kept as its spare while empty),
//! copies the staged bytes in and maps it at the address: the allocation is then swapped out
//! as if the swap-out had pinned. A swap-in that comes first copies the staged bytes straight
//! onto fresh device memory.
//!
//! Invariant: an entry with [`Backed::staged`] is swapped out, in host memory (its bytes the
//! host class), its address maps nothing and its `handle` names no memory; [`HostBacked`]'s
//! `staged` count is the number of such entries.

use std::sync::atomic::Ordering;

use vgpu_alloc_core::{OutOfMemory, UsageClass, UsageLedger};
use vgpu_cuda_abi::*;

use super::swap::in_context;
use super::{
    Backed, HOST_RESERVE, HostBacked, Place, create_on_host, device_location, host_headroom,
};
use super::{granularity, host_location};
use crate::driver;
use crate::ledger::SharedLedger;
use crate::log::{INFO, MSG, vlog};
use crate::real::Cuda;

/// Pageable host memory holding one staged allocation's bytes: an anonymous private mapping
/// of this process (huge pages asked for), unmapped when dropped.
#[derive(Debug)]
pub(crate) struct Staged {
    addr: usize,
    len: usize,
}

// SAFETY: the mapping belongs to this value alone and is plain memory, usable from any thread.
unsafe impl Send for Staged {}

impl Staged {
    /// Fresh pageable memory of `len` bytes (not touched: the copy faults it in), or `None`
    /// where the kernel refuses the mapping.
    fn new(len: u64) -> Option<Staged> {
        let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
        let p = crate::ffi::map_anonymous(len)?;
        // SAFETY: advice on the mapping just made (a refusal changes nothing but speed).
        let _ = unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        Some(Staged {
            addr: p as usize,
            len,
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is readable for `len` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is writable for `len` bytes, and `&mut self` makes this the
        // only view of it.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, unmapped once (no view of it outlives `self`).
        let _ = unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// One swap-out through pageable memory: the host class charged, the bytes copied out, the
/// address unmapped, then the device memory and its data charge released. `Ok(false)`: no
/// pageable memory could be had (nothing changed: the caller pins instead). A failure leaves
/// the allocation on the device, mapped and intact, and nothing charged.
pub(super) fn stage_out(
    cuda: &Cuda,
    ledger: &SharedLedger,
    va: CUdeviceptr,
    e: &mut Backed,
) -> Result<bool, CUresult> {
    let Some(mut staged) = Staged::new(e.size) else {
        return Ok(false);
    };
    ledger
        .reserve_swap_out(e.device, e.size)
        .map_err(|_: OutOfMemory| CUresult::OUT_OF_MEMORY)?;
    let moved = driver::copy_dtoh(cuda, staged.bytes_mut(), va)
        .and_then(|()| driver::unmap(cuda, va, e.size));
    if let Err(code) = moved {
        ledger.release_host(e.device, e.size);
        return Err(code);
    }
    let _ = driver::mem_release(cuda, e.handle);
    ledger.release(e.device, UsageClass::Data, e.size);
    e.handle = CUmemGenericAllocationHandle(0);
    e.place = Place::Host;
    e.swapped = true;
    e.staged = Some(staged);
    Ok(true)
}

/// One swap-in of a staged allocation: device room charged, fresh device memory mapped at its
/// address and filled from the staged bytes, then the host charge released and the staged
/// bytes freed. A failure leaves it staged, whole, and nothing more charged.
pub(super) fn stage_in(
    cuda: &Cuda,
    ledger: &SharedLedger,
    va: CUdeviceptr,
    e: &mut Backed,
) -> Result<(), CUresult> {
    let Some(staged) = e.staged.as_ref() else {
        return Err(CUresult::INVALID_VALUE);
    };
    ledger
        .try_reserve_move(e.device, e.size)
        .map_err(|_: OutOfMemory| CUresult::OUT_OF_MEMORY)?;
    let prop = driver::pinned_prop(device_location(e.ordinal));
    let placed = driver::mem_create(cuda, e.size, &prop).and_then(|h| {
        let filled = driver::map_for_device(cuda, va, e.size, h, e.ordinal).and_then(|()| {
            driver::copy_htod(cuda, va, staged.bytes()).inspect_err(|_| {
                let _ = driver::unmap(cuda, va, e.size);
            })
        });
        match filled {
            Ok(()) => Ok(h),
            Err(code) => {
                let _ = driver::mem_release(cuda, h);
                Err(code)
            }
        }
    });
    match placed {
        Ok(h) => {
            ledger.release_host(e.device, e.size);
            e.handle = h;
            e.place = Place::Device;
            e.staged = None;
            Ok(())
        }
        Err(code) => {
            ledger.release(e.device, UsageClass::Data, e.size);
            Err(code)
        }
    }
}

impl HostBacked {
    /// Whether any allocation is staged (one relaxed load).
    pub(crate) fn any_staged(&self) -> bool {
        self.staged.load(Ordering::Relaxed) != 0
    }

    /// Whether `ptr` is in a staged allocation (its address maps nothing now).
    pub(crate) fn staged_at(&self, ptr: CUdeviceptr) -> bool {
        if !self.any_staged() {
            return false;
        }
        let entries = self.lock();
        entries
            .range(..=ptr.0)
            .next_back()
            .is_some_and(|(&va, e)| ptr.0 < va + e.size && e.staged.is_some())
    }

    /// Pins host memory for the largest staged allocation that has none, with no lock held
    /// while it pins (the slow part), and keeps it as that allocation's spare (the slot's
    /// kept bytes) if it is still staged without one. The bytes pinned (0: the allocation
    /// left meanwhile), `None` with nothing left to pin, or where the host refuses: the
    /// memory cgroup would keep less than [`HOST_RESERVE`] (said once per swap-out) or the
    /// pinning failed (said by it); the staged ones then stay staged until their swap-in.
    pub(crate) fn pin_for_staged(&self, cuda: &Cuda, ledger: &SharedLedger) -> Option<u64> {
        if self.staging_refused.load(Ordering::Relaxed) {
            return None;
        }
        let (va, size, ctx) = {
            let entries = self.lock();
            let (&va, e) = entries
                .iter()
                .filter(|(_, e)| e.staged.is_some() && e.spare.is_none())
                .max_by_key(|(_, e)| e.size)?;
            (va, e.size, e.context)
        };
        let refused = |why: String| {
            if !self.staging_refused.swap(true, Ordering::Relaxed) {
                vlog!(
                    MSG,
                    "staged swapped-out memory stays in pageable memory until its swap-in: {why}"
                );
            }
            None
        };
        if let Some(room) = host_headroom().filter(|&r| r < size.saturating_add(HOST_RESERVE)) {
            return refused(format!(
                "pinning {size} bytes more would leave the container's memory cgroup {room} \
                 bytes"
            ));
        }
        let Ok(pinned) = in_context(cuda, ctx as CUcontext, || {
            create_on_host(cuda, size, 0, &|| false)
        }) else {
            return refused("the host refused to pin it".into());
        };
        let mut entries = self.lock();
        match entries.get_mut(&va) {
            // Still staged, or swapped in meanwhile (then kept all the same for its next
            // swap-out), if it has no spare yet.
            Some(e)
                if e.size == size
                    && e.spare.is_none()
                    && (e.staged.is_some() || e.place == Place::Device) =>
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

    /// Moves one staged allocation that has pinned memory kept into that memory (a copy
    /// through a second address, then the memory mapped at the allocation's address) and
    /// frees its staged bytes: it is then swapped out as if the swap-out had pinned. The
    /// caller holds the swap lock (the process is swapped out, so nothing can use the
    /// address). The bytes moved, 0 if none was ready; a failure leaves it staged, with its
    /// spare kept.
    pub(crate) fn fill_staged(&self, cuda: &Cuda, ledger: &SharedLedger) -> u64 {
        let mut entries = self.lock();
        let Some((&va, e)) = entries
            .iter_mut()
            .find(|(_, e)| e.staged.is_some() && !e.spare.is_none())
        else {
            return 0;
        };
        let Some(pinned) = e.spare.take(ledger, e.size) else {
            return 0;
        };
        let filled = in_context(cuda, e.context as CUcontext, || {
            fill(cuda, e, pinned)?;
            driver::map_for_device(cuda, CUdeviceptr(va), e.size, pinned, e.ordinal)
        });
        match filled {
            Ok(()) => {
                e.handle = pinned;
                e.staged = None;
                self.staged.fetch_sub(1, Ordering::Release);
                vlog!(
                    INFO,
                    "moved {} staged bytes into pinned host memory at {va:#x}",
                    e.size
                );
                e.size
            }
            Err(code) => {
                e.spare.keep(cuda, ledger, pinned, e.size);
                vlog!(
                    MSG,
                    "moving {} staged bytes at {va:#x} into pinned host memory failed (error \
                     {}); they stay staged",
                    e.size,
                    code.0
                );
                0
            }
        }
    }
}

/// `e`'s staged bytes copied into `pinned` (host-located memory of its size) through a
/// second address of the device's address space.
fn fill(cuda: &Cuda, e: &Backed, pinned: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    let Some(staged) = e.staged.as_ref() else {
        return Err(CUresult::INVALID_VALUE);
    };
    let prop = driver::pinned_prop(host_location());
    let second = driver::address_reserve(cuda, e.size, granularity(cuda, &prop))?;
    let r = driver::map_for_device(cuda, second, e.size, pinned, e.ordinal).and_then(|()| {
        let c = driver::copy_htod(cuda, second, staged.bytes());
        let _ = driver::unmap(cuda, second, e.size);
        c
    });
    let _ = driver::address_free(cuda, second, e.size);
    r
}
