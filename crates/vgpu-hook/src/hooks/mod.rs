//! The implementation behind every export, one file per subsystem; this file holds what
//! they share (error mapping, the pool retry).
//!
//! The declaration list (`vgpu-cuda-abi`) says each hook's shape and `crate::exports`
//! generates the export from it: a thin hook ("forward, then `f`") is a follow-up `f` here,
//! a twin (`_ptsz`) is its legacy sibling's body called with `StreamKind::PerThread`, and
//! every other hook is a function of the symbol's name taking the program's call as a
//! [`Forward`]. All of them return `Result<(), CUresult>`; the export turns it into the code.
//!
//! FFI boundary: raw caller pointers are read and written here through `crate::ffi`; all
//! accounting decisions are made by the allocator (`vgpu-alloc-core`), [`crate::measured`]
//! and [`crate::accounting`], which are safe Rust.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::sync::atomic::Ordering;

use vgpu_alloc_core::{
    AllocError, AllocationKind, ContextId, DeviceBackend, DeviceIndex, DevicePtr, FreeError,
    MAX_DEVICES, OutOfMemory, PendingRecord, UsageClass, UsageLedger,
};
use vgpu_cuda_abi::*;

use crate::accounting::{
    DEVICE_PAGE, align_up, array2d_bytes, array3d_bytes, measured_growth, mipmapped_bytes,
    virtual_mem_info, virtual_nvml_info,
};
use crate::driver;
use crate::driver::ProcessUsage;
use crate::ffi::{read_back, read_in, write_out};
use crate::log::{DEBUG, ERROR, INFO, MSG, WARN, vlog};
use crate::real::{self, Cuda};
use crate::residual::OverLimit;
use crate::sm_limit;
use crate::state::{self, Enforcement, Ready};

/// The program's own call, forwarded unchanged to the real function (the export builds it:
/// forwarding the caller's arguments as they came needs nothing but the caller's contract).
pub(crate) trait Forward: Fn(&Cuda) -> Result<(), CUresult> {}

impl<F: Fn(&Cuda) -> Result<(), CUresult>> Forward for F {}

fn dev_index(dev: CUdevice) -> Option<DeviceIndex> {
    (0..MAX_DEVICES as i32)
        .contains(&dev.0)
        .then_some(DeviceIndex(dev.0 as u32))
}

/// Locks one of the process state's maps, poisoned or not: each critical section leaves its
/// map consistent, and a hook must keep enforcing after a panic elsewhere was caught.
fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ctx_id(ctx: CUcontext) -> ContextId {
    ContextId(ctx as u64)
}

/// Memory not tied to a context (VMM handles, pools, graph memory) is keyed by context 0,
/// so destroying a context does not release it.
const NO_CONTEXT: ContextId = ContextId(0);

/// [`state::ready`] with the working case inlined into the allocation paths (the refusal,
/// logged there, stays out of line).
#[inline(always)]
fn ready() -> Result<&'static Ready, CUresult> {
    match state::get() {
        Enforcement::Ready(r) => Ok(r),
        Enforcement::Broken(_) => refused(),
    }
}

#[cold]
#[inline(never)]
fn refused() -> Result<&'static Ready, CUresult> {
    state::ready()
}

fn ready_state() -> Option<&'static Ready> {
    match state::get() {
        Enforcement::Ready(r) => Some(r),
        Enforcement::Broken(_) => None,
    }
}

fn log_oom(oom: &OutOfMemory) -> CUresult {
    if crate::state::has_left() {
        // Once: a thread allocating in a loop while the process exits would repeat it.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            vlog!(
                MSG,
                "refusing {} bytes on device {}: this process is exiting and has given its usage \
                 back (further refusals while exiting are not logged)",
                oom.requested,
                oom.device
            );
        }
        return CUresult::OUT_OF_MEMORY;
    }
    // The limit's refusals (not the hook's own, which carry no limit) are counted in the
    // file for `vgpu status`, `watch` and the exporter.
    if oom.limit != 0 {
        if let Some(st) = ready_state() {
            st.alloc.ledger().count_refusal(oom.device);
        }
    }
    vlog!(MSG, "{oom}");
    CUresult::OUT_OF_MEMORY
}

fn alloc_err(e: AllocError) -> CUresult {
    match e {
        AllocError::InvalidValue(_) => CUresult::INVALID_VALUE,
        AllocError::SizeOverflow { .. } => CUresult::OUT_OF_MEMORY,
        AllocError::OutOfMemory(oom) => log_oom(&oom),
        AllocError::Backend(b) => CUresult(b.code),
        AllocError::Internal(why) => {
            vlog!(ERROR, "internal accounting error: {why}");
            CUresult::UNKNOWN
        }
    }
}

/// Tracks `pending` under `key`, the address or handle the driver returned. A record that
/// cannot be kept is only logged (`what` names it): the allocation exists, and its charge
/// stays until the process exits.
fn commit<B: DeviceBackend, L: UsageLedger>(
    pending: PendingRecord<'_, B, L>,
    key: u64,
    what: &str,
) {
    if let Err(e) = pending.commit(key) {
        vlog!(
            ERROR,
            "could not record {what}: {e}; its charge stays until the process exits"
        );
    }
}

/// What [`charge_then_forward`] charges: `charge` bytes for `requested`, as `kind`, on
/// `device` in `context`; `what` names it in the log.
struct Charge<'a> {
    kind: AllocationKind,
    device: DeviceIndex,
    context: ContextId,
    requested: u64,
    charge: u64,
    what: &'a str,
}

/// Charges before the driver sees the call (a refusal fails it with the allocator's code),
/// forwards the call and records the new object under the key `key` reads from the
/// driver's answer. A failed call gives the charge back.
fn charge_and_forward(
    st: &Ready,
    cuda: &Cuda,
    forward: impl Forward,
    c: Charge<'_>,
    key: impl FnOnce() -> u64,
) -> Result<(), CUresult> {
    if let Some(pending) = charge_then_forward(st, cuda, forward, &c, |e| Err(alloc_err(e)))? {
        commit(pending, key(), c.what);
    }
    Ok(())
}

/// A charge begun and not yet recorded.
type Pending<'s> = PendingRecord<'s, driver::RealBackend, crate::ledger::SharedLedger>;

/// Charges `c` before the driver sees the call (the pools re-measured once if the limit
/// refuses) and forwards the call: the pending charge once the driver succeeded, for the
/// caller to correct and record. When the driver is out of memory, less urgent containers
/// may swap out to make room (`swap::room`), and the call is made once more. When the limit
/// refuses, or the driver is still out of memory, nothing stays charged and `full` answers
/// with the reason: a host-backed stand-in
/// (`None` once made) or the refusal's code. Any other driver error is the answer.
fn charge_then_forward<'s>(
    st: &'s Ready,
    cuda: &Cuda,
    forward: impl Forward,
    c: &Charge<'_>,
    full: impl FnOnce(AllocError) -> Result<(), CUresult>,
) -> Result<Option<Pending<'s>>, CUresult> {
    if takes_device_memory_at_creation(c.kind) {
        if let Some(free) = reserve_breach(st, cuda, c.device, c.charge) {
            return keep_reserve(st, (c.device, c.charge), free, full).map(|()| None);
        }
    }
    let mut asked = false;
    loop {
        let begun = with_pool_retry(st, cuda, || {
            st.alloc
                .begin_record(c.kind, c.device, c.context, c.requested, c.charge)
        });
        let pending = match begun {
            Ok(pending) => pending,
            Err(e) => return full(e).map(|()| None),
        };
        let Err(code) = forward(cuda) else {
            return Ok(Some(pending));
        };
        drop(pending);
        if code != CUresult::OUT_OF_MEMORY {
            return Err(code);
        }
        // No room on the GPU: less urgent containers may swap out for it, once.
        if !asked && crate::swap::room::made(st, cuda, CUdevice(c.device.0 as i32), c.charge) {
            asked = true;
            continue;
        }
        let driver_full = AllocError::Backend(vgpu_alloc_core::BackendError { code: code.0 });
        return full(driver_full).map(|()| None);
    }
}

/// Whether the driver takes memory of `kind` from the device when it is created, where the
/// hook places it: the device reserve holds against these. (Pools and graph memory take
/// theirs inside the driver, at times the hook does not see; managed memory is placed at
/// first touch.)
fn takes_device_memory_at_creation(kind: AllocationKind) -> bool {
    matches!(
        kind,
        AllocationKind::Direct
            | AllocationKind::SubAllocated
            | AllocationKind::Pitched
            | AllocationKind::VmmHandle
            | AllocationKind::Array
            | AllocationKind::MipmappedArray
    )
}

/// With host backing on and `VGPU_DEVICE_RESERVE` set: the GPU's free memory, if placing
/// `bytes` on `device` would leave it less than the reserve (one free-memory query; none
/// while the reserve is unset).
#[inline(always)]
fn reserve_breach(st: &Ready, cuda: &Cuda, device: DeviceIndex, bytes: u64) -> Option<u64> {
    let backing = &st.config.host_backing;
    if backing.device_reserve == 0 || !backing.enabled() {
        return None;
    }
    crate::host_backing::breaks_reserve(
        cuda,
        CUdevice(device.0 as i32),
        backing.device_reserve,
        bytes,
    )
}

/// `bytes` on `device` would break the reserve (the GPU has `free`): `place` puts them in
/// host memory where the path can (as when the GPU is full), else the allocation is refused
/// with a line saying why.
#[cold]
#[inline(never)]
fn keep_reserve<T>(
    st: &Ready,
    (device, bytes): (DeviceIndex, u64),
    free: u64,
    place: impl FnOnce(AllocError) -> Result<T, CUresult>,
) -> Result<T, CUresult> {
    let gpu_full = AllocError::Backend(vgpu_alloc_core::BackendError {
        code: CUresult::OUT_OF_MEMORY.0,
    });
    let placed = place(gpu_full);
    if placed.is_err() {
        vlog!(
            MSG,
            "refusing {bytes} bytes on device {device}: the GPU has {free} bytes free and \
             VGPU_DEVICE_RESERVE keeps {} of them free",
            st.config.host_backing.device_reserve
        );
    }
    placed
}

/// An allocation the device could not take (`refused`): `make` stands it in host memory when
/// host backing is on and the refusal was for room (the limit's, or the driver's out of
/// memory), else `refused` is the program's answer (logged).
#[cold]
#[inline(never)]
fn host_backed_instead<T, E>(
    st: &Ready,
    refused: AllocError,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<T, CUresult> {
    let device_full = match &refused {
        AllocError::OutOfMemory(_) => true,
        AllocError::Backend(b) => CUresult(b.code) == CUresult::OUT_OF_MEMORY,
        _ => false,
    };
    if device_full && st.config.host_backing.enabled() {
        if let Ok(made) = make() {
            return Ok(made);
        }
    }
    Err(alloc_err(refused))
}

/// Runs `f`; if the limit refused and pools may hold releasable memory, re-measure the pools
/// (they give memory back at their own pace) and try once more. The retry is out of line,
/// so the first try inlines into the allocation path.
#[inline(always)]
fn with_pool_retry<T>(
    st: &Ready,
    cuda: &Cuda,
    mut f: impl FnMut() -> Result<T, AllocError>,
) -> Result<T, AllocError> {
    match f() {
        Err(AllocError::OutOfMemory(oom)) if st.pools.is_active() || st.residual.any_charged() => {
            retry_after_making_room(st, cuda, oom.device, &mut f)
        }
        r => r,
    }
}

#[cold]
#[inline(never)]
fn retry_after_making_room<T>(
    st: &Ready,
    cuda: &Cuda,
    device: DeviceIndex,
    f: &mut dyn FnMut() -> Result<T, AllocError>,
) -> Result<T, AllocError> {
    if st.pools.is_active() {
        settle_all_pools(st, cuda);
    }
    // Code unloaded since the last reconciliation may leave room.
    if st.residual.any_charged() {
        let _ = reconcile(st, cuda, device, OverLimit::Charge);
    }
    f()
}

// Files whose hooks read or write the caller's pointers (out-pointers the driver filled,
// descriptors, attribute arrays) allow unsafe code at their top; the rest are safe Rust.
mod arrays;
mod contexts;
mod graphs;
mod init;
mod launches;
mod memory;
mod modules;
mod pools;
mod residual_charge;
mod synchronization;
mod views;
mod vmm;

pub(crate) use arrays::*;
pub(crate) use contexts::*;
pub(crate) use graphs::*;
pub(crate) use init::*;
pub(crate) use launches::*;
pub(crate) use memory::*;
pub(crate) use modules::*;
pub(crate) use pools::*;
use residual_charge::*;
pub(crate) use synchronization::*;
pub(crate) use views::*;
pub(crate) use vmm::*;
