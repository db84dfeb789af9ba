//! The program's own VMM handles (docs/swap.md, "The program's own VMM handles"): every
//! device-located `cuMemCreate` the program made through the hook, with where it is mapped
//! and with which access, so that a swap-out can move it to host memory at the same
//! addresses and a swap-in can bring it back, as for the hook's own allocations.
//!
//! Invariants (held under the table's lock; every call that changes them passes the swap
//! gate, so none runs while a swap moves memory):
//! - a handle's program value (what `cuMemCreate` answered) never changes; `real` is the
//!   driver's handle holding its memory now (a host-located one while it is swapped out, a
//!   new device-located one after its first swap-in). `by_real` is the reverse.
//! - the hook holds exactly one driver reference to `real` while the program holds any
//!   (`refs` counts the program's own: its creation and its retains), and always one while it
//!   is in host memory; the program's releases and retains only count, but the last.
//! - the charge is the allocator's record under the program value: data bytes while on the
//!   device, moved to host bytes by the swap-out (the record stays), given back when the
//!   memory really goes (the program released it and nothing maps it any more).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use vgpu_alloc_core::{DeviceIndex, OutOfMemory, UsageClass, UsageLedger};
use vgpu_cuda_abi::*;

use super::swap::{Moved, Swappable, in_context};
use super::{DeviceContexts, Place, Spare, create_on_host, device_location, granularity};
use crate::driver;
use crate::ledger::SharedLedger;
use crate::log::{INFO, WARN, vlog};
use crate::real::Cuda;

/// Why an imported handle stays: its memory is the exporter's.
const IMPORTED: &str = "it was imported from a shareable handle (the exporter's memory, which it \
                        may be writing; charged to the exporter)";

/// One mapping of a handle: `size` bytes of it from `offset`, at `va`.
#[derive(Debug, Clone)]
struct Mapping {
    va: u64,
    size: u64,
    offset: u64,
    /// The access the program set on the whole mapping, one descriptor per location.
    access: Vec<CUmemAccessDesc>,
    /// Access was set on a part of it only: a move could not give it back as it was.
    partial_access: bool,
}

/// The properties a handle was created with (without the Windows-only pointer, so that the
/// table can be shared between threads).
#[derive(Debug, Clone, Copy)]
struct Prop {
    type_: CUmemAllocationType,
    handle_types: std::ffi::c_uint,
    location: CUmemLocation,
    flags: CUmemAllocationPropFlags,
}

impl Prop {
    fn to_c(self) -> CUmemAllocationProp {
        CUmemAllocationProp {
            type_: self.type_,
            requestedHandleTypes: self.handle_types,
            location: self.location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: self.flags,
        }
    }
}

#[derive(Debug)]
struct Handle {
    device: DeviceIndex,
    ordinal: CUdevice,
    /// Its size (and charge): a multiple of the granularity, as the driver requires.
    size: u64,
    prop: Prop,
    real: CUmemGenericAllocationHandle,
    place: Place,
    maps: Vec<Mapping>,
    /// The program's references: 1 from `cuMemCreate`, one per retain, less its releases.
    refs: u32,
    /// Why it never moves, if it must not (another process may map it).
    stays: Option<&'static str>,
    /// Pinned host memory its last swap-in emptied (or pinned ahead), kept for its next
    /// swap-out (`VGPU_SWAP_KEEP_HOST`, as `Backed::spare`).
    spare: Spare,
}

impl Handle {
    /// A handle of `size` bytes on `device` just made or imported: on the device, unmapped,
    /// one reference of the program's.
    fn new(
        real: CUmemGenericAllocationHandle,
        (device, ordinal): (DeviceIndex, CUdevice),
        size: u64,
        prop: Prop,
        stays: Option<&'static str>,
    ) -> Self {
        Self {
            device,
            ordinal,
            size,
            prop,
            real,
            place: Place::Device,
            maps: Vec::new(),
            refs: 1,
            stays,
            spare: Spare::default(),
        }
    }

    /// The mapping of the whole handle at offset 0, through which it is copied.
    fn whole(&self) -> Option<u64> {
        self.maps
            .iter()
            .find(|m| m.offset == 0 && m.size == self.size)
            .map(|m| m.va)
    }

    /// Why it cannot move now, if it cannot.
    fn unmovable(&self) -> Option<&'static str> {
        if let Some(why) = self.stays {
            return Some(why);
        }
        if self.whole().is_none() {
            return Some("it is not mapped whole at offset 0");
        }
        if self
            .maps
            .iter()
            .any(|m| m.partial_access || m.access.is_empty())
        {
            return Some("access was set on part of a mapping, or not at all");
        }
        None
    }

    /// The devices that can reach it: its own and those its mappings grant access to.
    fn devices(&self) -> Vec<CUdevice> {
        let mut d = vec![self.ordinal];
        for a in self.maps.iter().flat_map(|m| &m.access) {
            let dev = CUdevice(a.location.id);
            if a.location.type_ == CUmemLocationType::DEVICE && !d.contains(&dev) {
                d.push(dev);
            }
        }
        d
    }
}

#[derive(Debug, Default)]
struct Table {
    by_value: HashMap<u64, Handle>,
    by_real: HashMap<u64, u64>,
    /// Mapped address to program value.
    by_va: BTreeMap<u64, u64>,
}

impl Table {
    /// Handles whose real handle is not the program's value.
    fn translated(&self) -> usize {
        self.by_value
            .iter()
            .filter(|(v, h)| **v != h.real.0)
            .count()
    }
}

/// This process's own device-located VMM handles.
#[derive(Debug, Default)]
pub(crate) struct ProgramVmm {
    table: Mutex<Table>,
    /// Handles recorded: 0 means a map or unmap needs no lookup.
    live: AtomicUsize,
    /// Handles whose program value is not their real handle: 0 means no translation.
    translated: AtomicUsize,
}

/// What a program's `cuMemRelease` of a recorded handle did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Released {
    /// Not a recorded handle: the caller forwards the call.
    NotOurs,
    /// A reference of the program fewer; the memory lives on (a retain, or its mappings).
    Kept,
    /// The memory is gone: its charge goes.
    Gone,
}

impl ProgramVmm {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn recount(&self, t: &Table) {
        self.live.store(t.by_value.len(), Ordering::Release);
        self.translated.store(t.translated(), Ordering::Release);
    }

    /// Whether `value` is the program's value of a handle that moved (the driver released
    /// it, and may hand it out again: a fresh handle of that value would be ambiguous to the
    /// program, so the caller asks the driver for another). Values of handles that did not
    /// move are the driver's own, live: it cannot hand them out.
    pub(crate) fn in_use(&self, value: u64) -> bool {
        self.translated.load(Ordering::Acquire) != 0
            && self
                .lock()
                .by_value
                .get(&value)
                .is_some_and(|h| h.real.0 != value)
    }

    /// The program's `cuMemCreate` of a device-located handle succeeded (and was charged
    /// `size` bytes on `device` under its value).
    pub(crate) fn created(
        &self,
        h: CUmemGenericAllocationHandle,
        (device, ordinal): (DeviceIndex, CUdevice),
        size: u64,
        prop: &CUmemAllocationProp,
    ) {
        // Shareable handle types alone do not keep it (PyTorch asks for POSIX descriptors on
        // every segment and exports only those it shares): an export does, and every export
        // passes through the hook.
        let stays = (prop.allocFlags.usage != 0)
            .then_some("it was created for a special usage (a tile pool)");
        let mut t = self.lock();
        t.by_real.insert(h.0, h.0);
        let prop = Prop {
            type_: prop.type_,
            handle_types: prop.requestedHandleTypes,
            location: prop.location,
            flags: prop.allocFlags,
        };
        t.by_value
            .insert(h.0, Handle::new(h, (device, ordinal), size, prop, stays));
        self.recount(&t);
    }

    /// The program imported `h` (`cuMemImportFromShareableHandle`) of memory on `device`: the
    /// exporter's, not charged here, never moved (its size grows with its mappings, for the
    /// log). A value recorded already is left as it is.
    pub(crate) fn imported(
        &self,
        h: CUmemGenericAllocationHandle,
        (device, ordinal): (DeviceIndex, CUdevice),
    ) {
        let mut t = self.lock();
        if t.by_value.contains_key(&h.0) || t.by_real.contains_key(&h.0) {
            return;
        }
        t.by_real.insert(h.0, h.0);
        let prop = Prop {
            type_: CUmemAllocationType::PINNED,
            handle_types: 0,
            location: device_location(ordinal),
            flags: CUmemAllocationPropFlags::default(),
        };
        t.by_value.insert(
            h.0,
            Handle::new(h, (device, ordinal), 0, prop, Some(IMPORTED)),
        );
        self.recount(&t);
    }

    /// The driver's handle for the program's `value` (itself unless it moved).
    pub(crate) fn translate(
        &self,
        value: CUmemGenericAllocationHandle,
    ) -> CUmemGenericAllocationHandle {
        if self.translated.load(Ordering::Acquire) == 0 {
            return value;
        }
        self.lock().by_value.get(&value.0).map_or(value, |h| h.real)
    }

    /// `value` must never move (exported, bound to a multicast object): `why`.
    pub(crate) fn stays(&self, value: CUmemGenericAllocationHandle, why: &'static str) {
        if let Some(h) = self.lock().by_value.get_mut(&value.0) {
            h.stays = Some(why);
        }
    }

    /// The program's `cuMemRelease` of `value`: only the last reference reaches the driver.
    pub(crate) fn release(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        value: CUmemGenericAllocationHandle,
    ) -> Result<Released, CUresult> {
        if self.live.load(Ordering::Acquire) == 0 {
            return Ok(Released::NotOurs);
        }
        let mut t = self.lock();
        let Some(h) = t.by_value.get_mut(&value.0) else {
            return Ok(Released::NotOurs);
        };
        match h.refs {
            // Released already: the driver says so, as without the hook.
            0 => return Err(CUresult::INVALID_VALUE),
            1 => driver::mem_release(cuda, h.real)?,
            _ => {}
        }
        h.refs -= 1;
        if h.refs > 0 || !h.maps.is_empty() {
            return Ok(Released::Kept);
        }
        self.forget(&mut t, cuda, ledger, value.0);
        Ok(Released::Gone)
    }

    fn forget(&self, t: &mut Table, cuda: &Cuda, ledger: &SharedLedger, value: u64) {
        if let Some(mut h) = t.by_value.remove(&value) {
            t.by_real.remove(&h.real.0);
            h.spare.release(cuda, ledger, h.size);
        }
        self.recount(t);
    }

    /// `cuMemRetainAllocationHandle` answered `real`: the program's value for it, if it is a
    /// recorded handle (one reference more; the hook keeps one driver reference only).
    pub(crate) fn retained(&self, cuda: &Cuda, real: CUmemGenericAllocationHandle) -> Option<u64> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut t = self.lock();
        let value = *t.by_real.get(&real.0)?;
        let h = t.by_value.get_mut(&value)?;
        if h.refs > 0 {
            let _ = driver::mem_release(cuda, real);
        }
        h.refs = h.refs.saturating_add(1);
        Some(value)
    }

    /// The program mapped `size` bytes of `value` from `offset` at `va`.
    pub(crate) fn mapped(
        &self,
        va: u64,
        size: u64,
        offset: u64,
        value: CUmemGenericAllocationHandle,
    ) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut t = self.lock();
        let Some(h) = t.by_value.get_mut(&value.0) else {
            return;
        };
        if h.stays == Some(IMPORTED) {
            h.size = h.size.max(offset.saturating_add(size));
        }
        h.maps.push(Mapping {
            va,
            size,
            offset,
            access: Vec::new(),
            partial_access: false,
        });
        t.by_va.insert(va, value.0);
    }

    /// The mappings of `range` the program's `(va, size)` covers.
    fn inside(t: &Table, va: u64, size: u64) -> Vec<(u64, u64)> {
        t.by_va
            .range(va..va.saturating_add(size))
            .map(|(&a, &v)| (a, v))
            .collect()
    }

    /// The program unmapped `[va, va + size)`: the handles whose memory went with it (released
    /// by the program before), whose charge the caller gives back.
    pub(crate) fn unmapped(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        va: u64,
        size: u64,
    ) -> Vec<u64> {
        if self.live.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut t = self.lock();
        let mut gone = Vec::new();
        for (a, value) in Self::inside(&t, va, size) {
            t.by_va.remove(&a);
            if let Some(h) = t.by_value.get_mut(&value) {
                h.maps.retain(|m| m.va != a);
                if h.maps.is_empty() && h.refs == 0 {
                    gone.push(value);
                }
            }
        }
        for &value in &gone {
            self.forget(&mut t, cuda, ledger, value);
        }
        gone
    }

    /// The program set `descs` on `[va, va + size)` (`all`: every descriptor it passed).
    pub(crate) fn access_set(&self, va: u64, size: u64, descs: &[CUmemAccessDesc], all: bool) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let end = va.saturating_add(size);
        let mut t = self.lock();
        // Mappings that start before `va` may reach into the range too.
        let start = t.by_va.range(..va).next_back().map_or(va, |(&a, _)| a);
        let touched: Vec<(u64, u64)> = t.by_va.range(start..end).map(|(&a, &v)| (a, v)).collect();
        for (a, value) in touched {
            let Some(h) = t.by_value.get_mut(&value) else {
                continue;
            };
            let Some(m) = h.maps.iter_mut().find(|m| m.va == a) else {
                continue;
            };
            if m.va.saturating_add(m.size) <= va {
                continue;
            }
            if !all || m.va < va || m.va.saturating_add(m.size) > end {
                m.partial_access = true;
                continue;
            }
            for d in descs {
                match m.access.iter_mut().find(|x| x.location == d.location) {
                    Some(x) => x.flags = d.flags,
                    None => m.access.push(*d),
                }
            }
        }
    }

    /// Adds what a swap-out would move of these handles to `s`.
    pub(crate) fn swappable(&self, s: &mut Swappable) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let t = self.lock();
        for h in t.by_value.values() {
            if h.place != Place::Device || h.unmovable().is_some() {
                continue;
            }
            s.bytes = s.bytes.saturating_add(h.size);
            if h.spare.is_none() {
                s.to_pin = s.to_pin.saturating_add(h.size);
            }
            for d in h.devices() {
                let c = (std::ptr::null_mut(), d);
                if !s.contexts.contains(&c) {
                    s.contexts.push(c);
                }
            }
        }
    }

    /// Moves every movable device-resident handle to host memory at its addresses (the move
    /// rule established by the caller); one that cannot move stays, said in the log.
    pub(crate) fn swap_out(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        contexts: &DeviceContexts,
        moved: &mut Moved,
        progress: &mut dyn FnMut(),
    ) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut t = self.lock();
        let values: Vec<u64> = t.by_value.keys().copied().collect();
        for value in values {
            let Some(h) = t.by_value.get_mut(&value) else {
                continue;
            };
            if h.place != Place::Device || h.maps.is_empty() {
                continue;
            }
            if let Some(why) = h.unmovable() {
                vlog!(
                    INFO,
                    "the program's VMM handle {value:#x} ({} bytes) stays on device {}: {why}",
                    h.size,
                    h.device.0
                );
                continue;
            }
            let Some(ctx) = a_context(contexts, h.ordinal) else {
                continue;
            };
            let old = h.real;
            let pinned_afresh = h.spare.is_none();
            match in_context(cuda, ctx, || move_out(cuda, ledger, h)) {
                Ok(()) => {
                    moved.bytes += h.size;
                    if pinned_afresh {
                        moved.pinned_afresh += h.size;
                    }
                    let new = h.real.0;
                    t.by_real.remove(&old.0);
                    t.by_real.insert(new, value);
                }
                Err(code) => vlog!(
                    WARN,
                    "swapping out the program's VMM handle {value:#x} ({} bytes) failed (error \
                     {}); it stays on device {}",
                    h.size,
                    code.0,
                    h.device.0
                ),
            }
            progress();
        }
        self.recount(&t);
    }

    /// Brings back every handle in host memory that has room (the GPU's free memory less
    /// `device_reserve`, and the limit's headroom); the bytes still out.
    pub(crate) fn swap_in(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        contexts: &DeviceContexts,
        (device_reserve, keep_host): (u64, bool),
    ) -> u64 {
        if self.live.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut t = self.lock();
        let mut out: Vec<(u64, u64)> = t
            .by_value
            .iter()
            .filter(|(_, h)| h.place == Place::Host)
            .map(|(&v, h)| (v, h.size))
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut short = 0u64;
        for (value, _) in out {
            let Some(h) = t.by_value.get_mut(&value) else {
                continue;
            };
            let Some(ctx) = a_context(contexts, h.ordinal) else {
                short += h.size;
                continue;
            };
            let old = h.real;
            let back = in_context(cuda, ctx, || {
                let (free, _) = driver::mem_get_info(cuda)?;
                if free.saturating_sub(device_reserve) < h.size {
                    return Err(CUresult::OUT_OF_MEMORY);
                }
                move_in(cuda, ledger, h)
            });
            match back {
                Ok(()) => {
                    if keep_host {
                        h.spare.keep(cuda, ledger, old, h.size);
                    } else {
                        let _ = driver::mem_release(cuda, old);
                    }
                    let new = h.real.0;
                    t.by_real.remove(&old.0);
                    t.by_real.insert(new, value);
                }
                Err(_) => short += h.size,
            }
        }
        self.recount(&t);
        short
    }

    /// Pins host memory ahead of a swap-out for the largest movable resident handle that has
    /// none kept (as `HostBacked::pin_ahead`: created with no lock held, kept if the handle
    /// is still there, resident and without): the bytes pinned, `None` if there was nothing
    /// to do or the pinning failed.
    pub(crate) fn pin_ahead(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        contexts: &DeviceContexts,
    ) -> Option<u64> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let (value, real, size, ordinal) = {
            let t = self.lock();
            let (&v, h) = t
                .by_value
                .iter()
                .filter(|(_, h)| {
                    h.place == Place::Device && h.spare.is_none() && h.unmovable().is_none()
                })
                .max_by_key(|(_, h)| h.size)?;
            (v, h.real, h.size, h.ordinal)
        };
        let ctx = a_context(contexts, ordinal)?;
        let pinned = in_context(cuda, ctx, || create_on_host(cuda, size, 0, &|| false)).ok()?;
        let mut t = self.lock();
        match t.by_value.get_mut(&value) {
            Some(h) if h.real == real && h.place == Place::Device && h.spare.is_none() => {
                h.spare.keep(cuda, ledger, pinned, size);
                Some(size)
            }
            _ => {
                drop(t);
                let _ = driver::mem_release(cuda, pinned);
                Some(0)
            }
        }
    }

    /// Gives back the host memory kept for swap-outs: the bytes.
    pub(crate) fn release_spares(&self, cuda: &Cuda, ledger: &SharedLedger) -> u64 {
        if self.live.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut bytes = 0;
        for h in self.lock().by_value.values_mut() {
            bytes += h.spare.release(cuda, ledger, h.size);
        }
        bytes
    }
}

/// A live context of `ordinal` (the swap-out proved them all idle), to copy in.
fn a_context(contexts: &DeviceContexts, ordinal: CUdevice) -> Option<CUcontext> {
    contexts
        .known_on(ordinal)
        .into_iter()
        .find(|&k| contexts.lives(k))
        .map(|k| k.ctx as CUcontext)
}

/// Copies `h`'s bytes into `new` through a second address (its whole mapping is the source).
fn fill(cuda: &Cuda, h: &Handle, new: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    let src = h.whole().ok_or(CUresult::INVALID_VALUE)?;
    let gran = granularity(cuda, &driver::pinned_prop(device_location(h.ordinal)));
    let staging = driver::address_reserve(cuda, h.size, gran)?;
    let r = driver::map_for_device(cuda, staging, h.size, new, h.ordinal).and_then(|()| {
        let c = driver::copy_dtod(cuda, staging, CUdeviceptr(src), h.size);
        let _ = driver::unmap(cuda, staging, h.size);
        c
    });
    let _ = driver::address_free(cuda, staging, h.size);
    r
}

/// Maps `new` in place of `h.real` at every mapping, with its access. On a failure every
/// mapping maps `h.real` again, as it did.
fn remap(cuda: &Cuda, h: &Handle, new: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    // `Err((code, true))`: the mapping was unmapped and is empty now.
    let one = |m: &Mapping, to: CUmemGenericAllocationHandle| {
        let p = CUdeviceptr(m.va);
        driver::unmap(cuda, p, m.size).map_err(|code| (code, false))?;
        driver::map(cuda, p, m.size, m.offset, to)
            .and_then(|()| {
                driver::set_access(cuda, p, m.size, &m.access).inspect_err(|_| {
                    let _ = driver::unmap(cuda, p, m.size);
                })
            })
            .map_err(|code| (code, true))
    };
    for (i, m) in h.maps.iter().enumerate() {
        if let Err((code, emptied)) = one(m, new) {
            // Back as it was: the failed one maps the old memory again if it was unmapped,
            // the earlier ones map the old memory instead of `new`.
            let p = CUdeviceptr(m.va);
            let mut whole = !emptied
                || driver::map(cuda, p, m.size, m.offset, h.real)
                    .and_then(|()| driver::set_access(cuda, p, m.size, &m.access))
                    .is_ok();
            for m in &h.maps[..i] {
                whole &= one(m, h.real).is_ok();
            }
            if !whole {
                vlog!(
                    WARN,
                    "{:#x}: could not map the program's memory again after a failed move",
                    m.va
                );
            }
            return Err(code);
        }
    }
    Ok(())
}

/// One swap-out: host bytes charged, a host allocation filled, every mapping remapped to it,
/// the device memory released last (the program's references to it with it), then the data
/// charge. A failure leaves the handle on the device, mapped and intact.
fn move_out(cuda: &Cuda, ledger: &SharedLedger, h: &mut Handle) -> Result<(), CUresult> {
    let host = h.spare.host_for_move_out(cuda, ledger, h.device, h.size)?;
    let undo = || ledger.release_host(h.device, h.size);
    // A reference of the hook's for the move (a handle the program released lives by its
    // mappings only, and the remap unmaps them one by one).
    let held = fill(cuda, h, host)
        .and_then(|()| driver::retain_at(cuda, h.whole().unwrap_or(0)))
        .and_then(|held| {
            remap(cuda, h, host).map(|()| held).inspect_err(|_| {
                let _ = driver::mem_release(cuda, held);
            })
        });
    let held = match held {
        Ok(held) => held,
        Err(code) => {
            let _ = driver::mem_release(cuda, host);
            undo();
            return Err(code);
        }
    };
    let _ = driver::mem_release(cuda, held);
    if h.refs > 0 {
        let _ = driver::mem_release(cuda, h.real);
    }
    ledger.release(h.device, UsageClass::Data, h.size);
    h.real = host;
    h.place = Place::Host;
    Ok(())
}

/// One swap-in: device room charged, a device handle of the same properties filled from the
/// host memory, every mapping remapped to it with its access, the host charge released. The
/// emptied host handle stays the caller's (`h.real` before). A failure leaves it in host
/// memory, mapped and intact.
fn move_in(cuda: &Cuda, ledger: &SharedLedger, h: &mut Handle) -> Result<(), CUresult> {
    let oom = |_: OutOfMemory| CUresult::OUT_OF_MEMORY;
    ledger.try_reserve_move(h.device, h.size).map_err(oom)?;
    let undo = || ledger.release(h.device, UsageClass::Data, h.size);
    let dev = match driver::mem_create(cuda, h.size, &h.prop.to_c()) {
        Ok(d) => d,
        Err(code) => {
            undo();
            return Err(code);
        }
    };
    if let Err(code) = fill(cuda, h, dev).and_then(|()| remap(cuda, h, dev)) {
        let _ = driver::mem_release(cuda, dev);
        undo();
        return Err(code);
    }
    ledger.release_host(h.device, h.size);
    // Released by the program: its mappings alone keep it, as before the swap.
    if h.refs == 0 {
        let _ = driver::mem_release(cuda, dev);
    }
    h.real = dev;
    h.place = Place::Device;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    fn rw() -> CUmemAccessDesc {
        CUmemAccessDesc {
            location: device_location(CUdevice(0)),
            flags: 3,
        }
    }

    fn table_with(size: u64) -> (ProgramVmm, CUmemGenericAllocationHandle) {
        let t = ProgramVmm::default();
        let h = CUmemGenericAllocationHandle(0x77);
        let prop = driver::pinned_prop(device_location(CUdevice(0)));
        t.created(h, (DeviceIndex(0), CUdevice(0)), size, &prop);
        (t, h)
    }

    fn movable_bytes(t: &ProgramVmm) -> u64 {
        let mut s = Swappable::default();
        t.swappable(&mut s);
        s.bytes
    }

    #[test]
    fn a_handle_moves_only_mapped_whole_at_offset_0_with_access_on_every_mapping() {
        let (t, h) = table_with(4 * M);
        assert_eq!(movable_bytes(&t), 0, "not mapped");
        t.mapped(0x1000_0000, 2 * M, 2 * M, h); // its second half
        t.access_set(0x1000_0000, 2 * M, &[rw()], true);
        assert_eq!(movable_bytes(&t), 0, "not mapped whole at offset 0");
        t.mapped(0x2000_0000, 4 * M, 0, h);
        assert_eq!(movable_bytes(&t), 0, "no access on the whole mapping yet");
        // One call over a range that covers the mapping (and more) counts for it.
        t.access_set(0x1fe0_0000, 8 * M, &[rw()], true);
        assert_eq!(movable_bytes(&t), 4 * M);
        // Access set on part of a mapping: it could not be given back exactly.
        t.access_set(0x2000_0000, 2 * M, &[rw()], true);
        assert_eq!(movable_bytes(&t), 0);
    }

    #[test]
    fn an_exported_handle_stays_and_values_translate_only_after_a_move() {
        let (t, h) = table_with(2 * M);
        t.mapped(0x3000_0000, 2 * M, 0, h);
        t.access_set(0x3000_0000, 2 * M, &[rw()], true);
        assert_eq!(t.translate(h), h, "nothing moved: no lookup");
        assert!(!t.in_use(h.0), "its value is the driver's own, live");
        t.stays(h, "it was exported to a shareable handle");
        assert_eq!(movable_bytes(&t), 0);
    }

    #[test]
    fn a_tile_pool_handle_never_moves() {
        let t = ProgramVmm::default();
        let h = CUmemGenericAllocationHandle(0x78);
        let mut prop = driver::pinned_prop(device_location(CUdevice(0)));
        prop.allocFlags.usage = 1;
        t.created(h, (DeviceIndex(0), CUdevice(0)), 2 * M, &prop);
        t.mapped(0x4000_0000, 2 * M, 0, h);
        t.access_set(0x4000_0000, 2 * M, &[rw()], true);
        assert_eq!(movable_bytes(&t), 0);
    }
}
