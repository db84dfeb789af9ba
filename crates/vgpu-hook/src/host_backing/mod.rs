//! Host-backed allocations (`CUDA_OVERSUBSCRIBE`, `VGPU_HOST_SPILL`; docs/oversubscription.md).
//!
//! Invariant: every host-backed allocation this process made is one entry here, keyed by its
//! device address, and is charged in the shared table exactly once: as host-backed bytes while
//! its address maps host memory, as data bytes once it moved onto the device. Its address
//! never changes.
//!
//! An allocation the device cannot take (the limit refuses it, or the GPU is full) is made
//! VMM-backed from the start: a reserved address range mapped to a host-located
//! `cuMemCreate` allocation that the device reads and writes over the bus. When device room
//! frees up, [`HostBacked::move_back`] (at `cuCtxSynchronize` of the device's only context,
//! when nothing can be using it: [`contexts`]) copies it into a device-located allocation and
//! remaps the same address to it.
//! Pinned `cuMemHostAlloc` memory could not do that (its device address is the driver's, and
//! cannot be remapped), and managed memory is never used (oversubscribing it can stall the
//! whole GPU for every tenant).
//!
//! Nothing here runs unless host backing is on: the allocation path reaches it only after a
//! refusal, the free path after one relaxed load finds entries.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use vgpu_alloc_core::{DeviceIndex, OutOfMemory, UsageClass, UsageLedger};
use vgpu_cuda_abi::*;

use crate::accounting::DEVICE_PAGE;
use crate::driver;
use crate::ledger::SharedLedger;
use crate::log::{INFO, MSG, WARN, vlog};
use crate::real::Cuda;

mod contexts;
pub(crate) mod program_vmm;
mod spare;
// The pageable staging memory: an anonymous mapping made, viewed and unmapped.
#[allow(unsafe_code)]
mod staged;
pub(crate) mod swap;
pub(crate) use contexts::DeviceContexts;
use spare::Spare;

/// Where an entry's address maps now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Host,
    Device,
}

#[derive(Debug)]
struct Backed {
    device: DeviceIndex,
    ordinal: CUdevice,
    /// The context it was allocated in (destroying it frees the allocation, as for
    /// `cuMemAlloc` memory).
    context: usize,
    /// Mapped (and charged) size: a multiple of the granularity.
    size: u64,
    handle: CUmemGenericAllocationHandle,
    place: Place,
    /// Allocation order (ties in the move-back order go to the oldest).
    seq: u64,
    /// In host memory because a swap-out moved it there (docs/swap.md): the swap-in brings it
    /// back, and until then the move back at a synchronize leaves it to the swap-in.
    swapped: bool,
    /// The pinned host memory its last swap-in emptied (or pinned ahead), kept for its next
    /// swap-out (`VGPU_SWAP_KEEP_HOST`): creating it is the slow part of a swap-out. Not
    /// charged in the shared file's classes (it holds none of the container's data), only
    /// shown as the slot's kept bytes; the memory cgroup counts it.
    spare: Spare,
    /// Its bytes while a swap-out staged them in pageable memory (docs/swap.md, "Pageable
    /// staging"): its address then maps nothing and `handle` names no memory.
    staged: Option<staged::Staged>,
}

/// This process's host-backed allocations.
#[derive(Debug, Default)]
pub(crate) struct HostBacked {
    entries: Mutex<BTreeMap<u64, Backed>>,
    /// Entries of any place: 0 means a free needs no lookup.
    live: AtomicUsize,
    /// Entries in host memory: 0 means nothing to move back.
    on_host: AtomicUsize,
    next_seq: AtomicU64,
    /// Entries staged in pageable memory: 0 means nothing to pin for them.
    staged: AtomicUsize,
    /// Pinning for staged entries was refused since the last swap-out: not tried again.
    staging_refused: AtomicBool,
    /// `cuMemCreate` handles of the program's own VMM path made in host memory instead of on
    /// the device (their charge is host-backed until the handle's release).
    vmm_handles: Mutex<BTreeMap<u64, (DeviceIndex, u64)>>,
    /// The process's contexts per device: who else could be using an allocation.
    pub(crate) contexts: DeviceContexts,
    /// The program's own device-located VMM handles, which move under swapping too.
    pub(crate) program: program_vmm::ProgramVmm,
}

/// The move-back order: the largest allocation that fits in `room`, the oldest among equals.
///
/// Without page-level tracking (no managed memory) the hook cannot see which allocation was
/// used most recently; what it can do is bring back as many bytes as the room allows with as
/// few moves (each one a copy and a remap) as possible, and the largest allocations are the
/// ones whose accesses cost most over the bus.
fn pick(entries: impl Iterator<Item = (u64, u64, u64)>, room: u64) -> Option<u64> {
    entries
        .filter(|&(_, size, _)| size <= room)
        .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)))
        .map(|(va, _, _)| va)
}

/// What the host lets this process pin now: its memory cgroup's headroom (pinned host
/// memory is charged to the cgroup, and past its limit the kernel's OOM killer ends the
/// container instead of refusing the pin, so the hook refuses first). `None` = unlimited.
pub(crate) fn host_headroom() -> Option<u64> {
    use vgpu_env::host_limits::{cgroup_headroom, cgroup_memory_files};
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let (max, current) = cgroup_memory_files(&read("/proc/self/cgroup")?)?;
    cgroup_headroom(&read(&max)?, &read(&current)?)
}

/// The GPU's free memory behind ordinal `dev`: `cuMemGetInfo` when it is the current
/// context's device, else NVML's figure (a `cuMemCreate` names its device, which need not be
/// the current one).
fn physical_free(cuda: &Cuda, dev: CUdevice) -> Option<u64> {
    match driver::current(cuda) {
        Ok((_, current)) if current == dev => driver::mem_get_info(cuda).ok().map(|(free, _)| free),
        _ => driver::nvml_free_bytes(cuda, dev),
    }
}

/// The GPU's free memory, if placing `bytes` on device `dev` would leave it less than
/// `reserve` (`VGPU_DEVICE_RESERVE`); an unknown answer says no.
pub(crate) fn breaks_reserve(cuda: &Cuda, dev: CUdevice, reserve: u64, bytes: u64) -> Option<u64> {
    physical_free(cuda, dev).filter(|&free| free < bytes.saturating_add(reserve))
}

/// Host memory left to the program after a spill: a cgroup with less headroom than this
/// after the pin is refused (the program itself needs host memory too).
pub(crate) const HOST_RESERVE: u64 = 256 << 20;

fn host_location() -> CUmemLocation {
    CUmemLocation {
        type_: CUmemLocationType::HOST,
        id: 0,
    }
}

fn device_location(ordinal: CUdevice) -> CUmemLocation {
    CUmemLocation {
        type_: CUmemLocationType::DEVICE,
        id: ordinal.0,
    }
}

fn granularity(cuda: &Cuda, prop: &CUmemAllocationProp) -> u64 {
    driver::granularity(cuda, prop)
        .ok()
        .filter(|&g| g > 0)
        .unwrap_or(DEVICE_PAGE)
}

/// Which step of [`map_fresh`] failed, with the driver's answer.
#[derive(Debug, Clone, Copy)]
enum Failed {
    Reserve(CUresult),
    Create(CUresult),
    Map(CUresult),
}

impl Failed {
    fn code(self) -> CUresult {
        match self {
            Failed::Reserve(e) | Failed::Create(e) | Failed::Map(e) => e,
        }
    }
}

/// A fresh address range of `size` mapped for `ordinal` to a new allocation that `create`
/// makes: the steps a host-backed and a movable allocation share. `Err` leaves nothing
/// behind.
fn map_fresh(
    cuda: &Cuda,
    size: u64,
    gran: u64,
    ordinal: CUdevice,
    create: impl FnOnce() -> Result<CUmemGenericAllocationHandle, CUresult>,
) -> Result<(CUdeviceptr, CUmemGenericAllocationHandle), Failed> {
    let va = driver::address_reserve(cuda, size, gran).map_err(Failed::Reserve)?;
    let h = match create() {
        Ok(h) => h,
        Err(e) => {
            let _ = driver::address_free(cuda, va, size);
            return Err(Failed::Create(e));
        }
    };
    if let Err(e) = driver::map_for_device(cuda, va, size, h, ordinal) {
        let _ = driver::mem_release(cuda, h);
        let _ = driver::address_free(cuda, va, size);
        return Err(Failed::Map(e));
    }
    Ok((va, h))
}

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_next_multiple_of(to.max(1))
}

impl HostBacked {
    /// Whether any allocation is host-backed or moved (one relaxed load).
    #[inline(always)]
    pub(crate) fn any(&self) -> bool {
        self.live.load(Ordering::Relaxed) != 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Backed>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the host lets this process pin `size` more bytes for the program's data,
    /// after giving back the host memory kept for swap-outs if that is what stands in the
    /// way; logs why not.
    fn host_room(&self, cuda: &Cuda, ledger: &SharedLedger, size: u64) -> bool {
        let short = host_headroom().is_some_and(|room| room < size.saturating_add(HOST_RESERVE));
        if !short {
            return true;
        }
        // Short: the kept memory goes, and the cgroup is read again (its refusal logged).
        self.release_spares(cuda, ledger);
        Self::host_allows(size)
    }

    /// Gives back the host memory kept for swap-outs (`Backed::spare`): the program's data
    /// comes before a faster swap-out. The bytes given back.
    fn release_spares(&self, cuda: &Cuda, ledger: &SharedLedger) -> u64 {
        let mut bytes = self.program.release_spares(cuda, ledger);
        for e in self.lock().values_mut() {
            bytes += e.spare.release(cuda, ledger, e.size);
        }
        if bytes > 0 {
            vlog!(
                INFO,
                "gave back {bytes} bytes of host memory kept for swap-outs: the program's data \
                 needs the room"
            );
        }
        bytes
    }

    /// Checks the host would let this process pin `size` more bytes; logs why not.
    fn host_allows(size: u64) -> bool {
        match host_headroom() {
            Some(room) if room < size.saturating_add(HOST_RESERVE) => {
                vlog!(
                    MSG,
                    "not backing {size} bytes with host memory: the container's memory cgroup \
                     has {room} bytes left and pinned memory counts against it"
                );
                false
            }
            _ => true,
        }
    }

    /// Records a new allocation at `va` (the table then owns its handle and mapping).
    fn adopt(
        &self,
        va: CUdeviceptr,
        device: DeviceIndex,
        (ordinal, context): (CUdevice, CUcontext),
        size: u64,
        handle: CUmemGenericAllocationHandle,
        place: Place,
    ) {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(
            va.0,
            Backed {
                device,
                ordinal,
                context: context as usize,
                size,
                handle,
                place,
                seq,
                swapped: false,
                spare: Spare::default(),
                staged: None,
            },
        );
        self.live.fetch_add(1, Ordering::Release);
    }

    /// Make a host-backed allocation of at least `bytes` at a device address of `ordinal`,
    /// charged as host-backed bytes on `device`. `Err` leaves nothing behind (the caller then
    /// answers as it would have without host backing).
    pub(crate) fn allocate(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        device: DeviceIndex,
        (ordinal, context): (CUdevice, CUcontext),
        bytes: u64,
    ) -> Result<CUdeviceptr, CUresult> {
        let prop = driver::pinned_prop(host_location());
        let gran = granularity(cuda, &prop);
        let size = round_up(bytes.max(1), gran).ok_or(CUresult::OUT_OF_MEMORY)?;
        if !self.host_room(cuda, ledger, size) {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        ledger.try_reserve_host(device, size).map_err(|oom| {
            vlog!(MSG, "host-backed memory refused too: {oom}");
            CUresult::OUT_OF_MEMORY
        })?;
        let cannot = |what: &str, e: CUresult| {
            vlog!(
                MSG,
                "cannot back {size} bytes with host memory: {what} failed (error {})",
                e.0
            );
            e
        };
        let (va, handle) = match map_fresh(cuda, size, gran, ordinal, || {
            create_on_host(cuda, size, 0, &|| self.release_spares(cuda, ledger) > 0)
        }) {
            Ok(m) => m,
            Err(failed) => {
                ledger.release_host(device, size);
                return Err(match failed {
                    Failed::Reserve(e) => cannot("reserving an address range", e),
                    Failed::Create(e) => e,
                    Failed::Map(e) => cannot("mapping it for the device", e),
                });
            }
        };
        self.adopt(va, device, (ordinal, context), size, handle, Place::Host);
        self.on_host.fetch_add(1, Ordering::Release);
        vlog!(
            INFO,
            "device {} is full for this container: {bytes} bytes at {:#x} are backed by host memory",
            device.0,
            va.0
        );
        Ok(va)
    }

    /// Free `ptr` if it is one of ours: `None` if it is not (the caller frees it as usual).
    pub(crate) fn free(&self, cuda: &Cuda, ledger: &SharedLedger, ptr: CUdeviceptr) -> Option<()> {
        let e = self.lock().remove(&ptr.0)?;
        // `cuMemFree` waits for the device's work before the memory goes (CUDA's implicit
        // synchronization); an unmap need not, so wait here: a kernel still reading the
        // allocation must not find its address unmapped.
        let _ = driver::ctx_synchronize(cuda);
        self.release(cuda, ledger, ptr, e);
        Some(())
    }

    /// Context `ctx` was destroyed: its allocations go with it, as `cuMemAlloc` memory does.
    pub(crate) fn context_gone(&self, cuda: &Cuda, ledger: &SharedLedger, ctx: usize) {
        if !self.any() {
            return;
        }
        let gone: Vec<(u64, Backed)> = {
            let mut entries = self.lock();
            let keys: Vec<u64> = entries
                .iter()
                .filter(|(_, e)| e.context == ctx)
                .map(|(&va, _)| va)
                .collect();
            keys.into_iter()
                .filter_map(|va| entries.remove(&va).map(|e| (va, e)))
                .collect()
        };
        for (va, e) in gone {
            self.release(cuda, ledger, CUdeviceptr(va), e);
        }
    }

    /// Unmaps and frees a removed entry and gives its charge back.
    fn release(&self, cuda: &Cuda, ledger: &SharedLedger, ptr: CUdeviceptr, mut e: Backed) {
        self.live.fetch_sub(1, Ordering::Release);
        if e.place == Place::Host {
            self.on_host.fetch_sub(1, Ordering::Release);
        }
        if e.staged.take().is_some() {
            // Its address maps nothing and it has no driver memory: the staged bytes go.
            self.staged.fetch_sub(1, Ordering::Release);
        } else {
            let _ = driver::unmap(cuda, ptr, e.size);
            let _ = driver::mem_release(cuda, e.handle);
        }
        e.spare.release(cuda, ledger, e.size);
        let _ = driver::address_free(cuda, ptr, e.size);
        match e.place {
            Place::Host => ledger.release_host(e.device, e.size),
            Place::Device => ledger.release(e.device, UsageClass::Data, e.size),
        }
    }

    /// The base and size of the allocation containing `ptr`, if it is one of ours.
    pub(crate) fn range(&self, ptr: CUdeviceptr) -> Option<(u64, u64)> {
        let entries = self.lock();
        let (&va, e) = entries.range(..=ptr.0).next_back()?;
        (ptr.0 < va + e.size).then_some((va, e.size))
    }

    /// Context `ctx` of device `ordinal` was just synchronized (successfully, current on the
    /// calling thread): move its host-backed allocations onto the device while room allows
    /// (largest first, see [`pick`]), if nothing else can be using them: `ctx` is the only
    /// context of the process on that device ([`DeviceContexts::alone_on`]), so the
    /// synchronize proved every context that can reach them idle. Each move keeps the address
    /// and the data; a move that fails leaves the allocation in host memory, as it was.
    pub(crate) fn move_back(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        (ordinal, ctx): (CUdevice, CUcontext),
        device_reserve: u64,
    ) {
        if self.on_host.load(Ordering::Acquire) == 0 {
            return;
        }
        if !self.contexts.alone_on(ctx as usize, ordinal) {
            said_once_that_moves_wait_for_one_context(ordinal);
            return;
        }
        // Held throughout: frees of these allocations wait for the move (never concurrent
        // with it), and two synchronizing threads do not move the same one.
        let mut entries = self.lock();
        loop {
            let Some(device) = entries
                .values()
                .find(|e| e.ordinal == ordinal)
                .map(|e| e.device)
            else {
                return;
            };
            let Ok((phys_free, _)) = driver::mem_get_info(cuda) else {
                return;
            };
            let usage = ledger.usage(device);
            let headroom = usage
                .limit
                .map_or(u64::MAX, |l| l.saturating_sub(usage.used));
            let room = phys_free.saturating_sub(device_reserve).min(headroom);
            let candidates = entries
                .iter()
                .filter(|(_, e)| {
                    e.place == Place::Host
                        && !e.swapped
                        && e.ordinal == ordinal
                        && e.context == ctx as usize
                })
                .map(|(&va, e)| (va, e.size, e.seq));
            let Some(va) = pick(candidates, room) else {
                return;
            };
            let Some(e) = entries.get_mut(&va) else {
                return;
            };
            match move_one(cuda, ledger, CUdeviceptr(va), e) {
                Ok(emptied) => {
                    let _ = driver::mem_release(cuda, emptied);
                    self.on_host.fetch_sub(1, Ordering::Release);
                    vlog!(
                        INFO,
                        "{} bytes at {va:#x} moved back onto device {}",
                        e.size,
                        device.0
                    );
                }
                Err(code) => {
                    vlog!(
                        WARN,
                        "moving {} bytes at {va:#x} back onto device {} failed (error {}); they \
                         stay in host memory",
                        e.size,
                        device.0,
                        code.0
                    );
                    return;
                }
            }
        }
    }

    /// The program's `cuMemCreate` on a device that cannot take it: a handle in host memory
    /// instead (the program maps it where it likes), charged as host-backed. Of the program's
    /// properties it keeps only what host memory can give: the shareable handle types, if
    /// the driver allows them there; the device-memory ones (the GPUDirect RDMA flag, which
    /// PyTorch's expandable segments set wherever the GPU supports it, compression, usage)
    /// would make the driver refuse the whole allocation.
    pub(crate) fn create_handle(
        &self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        device: DeviceIndex,
        size: u64,
        prop: &CUmemAllocationProp,
    ) -> Result<CUmemGenericAllocationHandle, CUresult> {
        let host = driver::pinned_prop(host_location());
        let size = round_up(size, granularity(cuda, &host)).ok_or(CUresult::OUT_OF_MEMORY)?;
        if !self.host_room(cuda, ledger, size) {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        ledger
            .try_reserve_host(device, size)
            .map_err(|oom: OutOfMemory| {
                vlog!(MSG, "host-backed memory refused too: {oom}");
                CUresult::OUT_OF_MEMORY
            })?;
        match create_on_host(cuda, size, prop.requestedHandleTypes, &|| {
            self.release_spares(cuda, ledger) > 0
        }) {
            Ok(h) => {
                self.vmm_handles
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(h.0, (device, size));
                vlog!(
                    INFO,
                    "device {} is full for this container: a cuMemCreate of {size} bytes is \
                     made in host memory",
                    device.0
                );
                Ok(h)
            }
            Err(e) => {
                ledger.release_host(device, size);
                Err(e)
            }
        }
    }

    /// A `cuMemRelease` of a handle [`HostBacked::create_handle`] made: true if it was one.
    pub(crate) fn handle_released(
        &self,
        ledger: &SharedLedger,
        h: CUmemGenericAllocationHandle,
    ) -> bool {
        let found = self
            .vmm_handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&h.0);
        if let Some((device, size)) = found {
            ledger.release_host(device, size);
        }
        found.is_some()
    }
}

/// A pinned host-located allocation of `size` bytes, exportable as `handle_types` if the
/// driver can make host memory so (else without: said once, since such a handle cannot be
/// exported). Every failure is said; the answer is then out-of-memory, as the caller's
/// allocation would have had without host backing.
fn create_on_host(
    cuda: &Cuda,
    size: u64,
    handle_types: std::ffi::c_uint,
    reclaim: &dyn Fn() -> bool,
) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let mut prop = driver::pinned_prop(host_location());
    prop.requestedHandleTypes = handle_types;
    let refused = match driver::mem_create(cuda, size, &prop) {
        Ok(h) => return Ok(h),
        Err(e) => e,
    };
    if refused == CUresult::OUT_OF_MEMORY && reclaim() {
        return create_on_host(cuda, size, handle_types, &|| false);
    }
    if handle_types != 0 && refused != CUresult::OUT_OF_MEMORY {
        if let Ok(h) = create_on_host(cuda, size, 0, reclaim) {
            said_once_that_handles_are_not_shareable(handle_types, refused);
            return Ok(h);
        }
        return Err(CUresult::OUT_OF_MEMORY);
    }
    if refused == CUresult::OUT_OF_MEMORY {
        vlog!(
            MSG,
            "the host refused to pin {size} bytes for device memory: RLIMIT_MEMLOCK or the \
             container's memory limit"
        );
    } else {
        vlog!(
            MSG,
            "cannot back {size} bytes with host memory: the driver refused a host-located \
             allocation (error {})",
            refused.0
        );
    }
    Err(CUresult::OUT_OF_MEMORY)
}

#[cold]
fn said_once_that_handles_are_not_shareable(handle_types: std::ffi::c_uint, refused: CUresult) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        vlog!(
            WARN,
            "the driver cannot make host memory shareable as handle types {handle_types:#x} \
             (error {}): host-backed cuMemCreate handles are made without, and cannot be \
             exported to other processes",
            refused.0
        );
    }
}

/// Host-backed memory of `ordinal` stays where it is while the device has another context of
/// this process (or one the hook did not see made): said once per process, since a program
/// with several contexts synchronizes often.
#[cold]
fn said_once_that_moves_wait_for_one_context(ordinal: CUdevice) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        vlog!(
            INFO,
            "device {}: host-backed memory is not moved back while this process has more than \
             one context there (a synchronize proves only its own context idle)",
            ordinal.0
        );
    }
}

/// One move: device room reserved in the table first, a device-located allocation filled
/// through a second address, then the allocation's own address remapped to it; the host
/// bytes' charge goes last. Both are charged in between, so a process killed mid-move leaves
/// the table exact (its slot gives both back). The emptied host allocation is the caller's
/// to release or keep.
fn move_one(
    cuda: &Cuda,
    ledger: &SharedLedger,
    va: CUdeviceptr,
    e: &mut Backed,
) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let oom = |_: OutOfMemory| CUresult::OUT_OF_MEMORY;
    ledger.try_reserve_move(e.device, e.size).map_err(oom)?;
    let undo_charge = || ledger.release(e.device, UsageClass::Data, e.size);
    let prop = driver::pinned_prop(device_location(e.ordinal));
    let dev_handle = match driver::mem_create(cuda, e.size, &prop) {
        Ok(h) => h,
        Err(code) => {
            undo_charge();
            return Err(code);
        }
    };
    if let Err(code) = rehome(cuda, va, e, dev_handle, &prop) {
        undo_charge();
        return Err(code);
    }
    ledger.release_host(e.device, e.size);
    let emptied = std::mem::replace(&mut e.handle, dev_handle);
    e.place = Place::Device;
    Ok(emptied)
}

/// The step every move shares: `e`'s bytes copied into `new` (a fresh allocation located as
/// `prop` says) through a second address, then `e`'s own address remapped to it. On any
/// failure `new` is released and the address maps `e.handle` again, its data whole; on
/// success `e.handle` is the caller's to release.
fn rehome(
    cuda: &Cuda,
    va: CUdeviceptr,
    e: &Backed,
    new: CUmemGenericAllocationHandle,
    prop: &CUmemAllocationProp,
) -> Result<(), CUresult> {
    let copied = (|| {
        let staging = driver::address_reserve(cuda, e.size, granularity(cuda, prop))?;
        let r = driver::map_for_device(cuda, staging, e.size, new, e.ordinal).and_then(|()| {
            let c = driver::copy_dtod(cuda, staging, va, e.size);
            let _ = driver::unmap(cuda, staging, e.size);
            c
        });
        let _ = driver::address_free(cuda, staging, e.size);
        r
    })()
    .and_then(|()| driver::unmap(cuda, va, e.size));
    if let Err(code) = copied {
        let _ = driver::mem_release(cuda, new);
        return Err(code);
    }
    if let Err(code) = driver::map_for_device(cuda, va, e.size, new, e.ordinal) {
        // Put the old memory back at the address: its data is still whole.
        if driver::map_for_device(cuda, va, e.size, e.handle, e.ordinal).is_err() {
            vlog!(
                WARN,
                "{:#x}: could not map its memory again after a failed move",
                va.0
            );
        }
        let _ = driver::mem_release(cuda, new);
        return Err(code);
    }
    Ok(())
}

/// `(free, total)` of a device under `CUDA_OVERSUBSCRIBE` with a `limit`: the device is as
/// large as the limit (HAMi's scaled share, which may exceed the GPU), and everything the
/// container holds against it, device-resident (`used`) or host-backed (`host`), is in use.
/// Frameworks that size their caches from `free` then plan within the limit, and whatever
/// the GPU cannot hold is host-backed.
pub(crate) fn oversubscribed_view(limit: u64, used: u64, host: u64) -> (u64, u64) {
    (limit.saturating_sub(used.saturating_add(host)), limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversubscribed_device_is_as_large_as_its_limit() {
        assert_eq!(oversubscribed_view(100, 30, 20), (50, 100));
        assert_eq!(oversubscribed_view(100, 90, 20), (0, 100));
    }

    #[test]
    fn the_largest_allocation_that_fits_moves_first_and_the_oldest_among_equals() {
        let entries = [(0xa, 4, 0), (0xb, 8, 1), (0xc, 8, 2), (0xd, 16, 3)];
        assert_eq!(pick(entries.into_iter(), 100), Some(0xd));
        assert_eq!(pick(entries.into_iter(), 15), Some(0xb), "oldest of the 8s");
        assert_eq!(pick(entries.into_iter(), 5), Some(0xa));
        assert_eq!(pick(entries.into_iter(), 3), None);
    }
}
