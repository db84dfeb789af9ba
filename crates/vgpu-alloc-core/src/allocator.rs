//! The decision the hook asks for on every allocation: sub-allocate or go direct,
//! reserve in the ledger, call the device, record; and the reverse on free.
//!
//! Locking: one mutex guards the table and the regions; it is never held across a
//! device call (driver calls can take milliseconds) and only briefly across ledger
//! calls (atomic updates). Ledger bytes are always reserved *before* the device is
//! asked and released only *after* the device freed them, so concurrent processes can
//! never together exceed a limit.

use std::sync::{Mutex, MutexGuard};

use crate::backend::{BackendError, ContextId, DeviceBackend, DevicePtr};
use crate::ledger::{DeviceIndex, DeviceUsage, OutOfMemory, Reservation, UsageClass, UsageLedger};
use crate::region::{Region, chunks_for};
use crate::table::{AllocId, Allocation, AllocationKind, AllocationTable, IdHashMap, Placement};
use crate::tuning::AllocatorConfig;

/// Why an allocation (or a reservation for one) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Size 0, a device the ledger does not account for ([`UsageLedger::has_device`]), or
    /// a kind the call cannot take; the hook answers `CUDA_ERROR_INVALID_VALUE` as the
    /// driver does.
    #[error("invalid value: {0}")]
    InvalidValue(&'static str),
    /// The size cannot be rounded up to the alignment in 64 bits; the hook answers
    /// `CUDA_ERROR_OUT_OF_MEMORY`, as the driver does for absurd sizes.
    #[error("a request of {requested} bytes cannot be accounted in 64 bits")]
    SizeOverflow {
        /// Bytes asked for.
        requested: u64,
    },
    /// The limit refuses it; the one line users see.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    /// The device refused it; the hook returns this code.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The allocator's own bookkeeping is inconsistent (a bug); nothing was allocated.
    #[error("internal allocator error: {0}")]
    Internal(&'static str),
}

/// Why a free could not be done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    /// Nothing tracked under that key: the hook passes the call through to the driver.
    #[error("not tracked")]
    NotTracked,
    /// The device refused to free it; the entry stays tracked and charged.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The allocator's own bookkeeping is inconsistent (a bug).
    #[error("internal allocator error: {0}")]
    Internal(&'static str),
}

/// A successful [`Allocator::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    /// The address for the program.
    pub ptr: DevicePtr,
    /// [`AllocationKind::SubAllocated`] or [`AllocationKind::Direct`].
    pub kind: AllocationKind,
    /// Bytes charged: whole chunks for a sub-allocation (its region was charged when it
    /// was created), the size rounded up to ALIGN for a direct one.
    pub accounted: u64,
}

/// What a free or release removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// The removed entry.
    pub allocation: Allocation,
    /// Bytes given back to the ledger by this call (a direct allocation's accounted
    /// size, a whole region when its last chunk went, or 0).
    pub released: u64,
}

/// Address range of the allocation containing an address (`cuMemGetAddressRange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRange {
    /// First byte of the allocation.
    pub base: DevicePtr,
    /// Its size as requested.
    pub size: u64,
    /// What made it.
    pub kind: AllocationKind,
    /// Its device.
    pub device: DeviceIndex,
    /// Its context.
    pub context: ContextId,
}

/// What [`Allocator::release_context`] dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ContextReleased {
    /// Table entries removed.
    pub allocations: usize,
    /// Regions dropped.
    pub regions: usize,
    /// Bytes given back to the ledger.
    pub released: u64,
}

/// One region as [`Allocator::regions`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its device.
    pub device: DeviceIndex,
    /// The context it serves.
    pub context: ContextId,
    /// Its first byte.
    pub base: DevicePtr,
    /// Chunks in it.
    pub chunks: u32,
    /// Chunks not in use.
    pub free_chunks: u32,
}

/// Counters for tests, logs and `vgpu` status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllocatorStats {
    /// Live table entries.
    pub live_allocations: usize,
    /// Regions held (all devices and contexts).
    pub regions: usize,
    /// Of those, regions with no chunk in use (kept warm).
    pub empty_regions: usize,
    /// Entries replaced because the driver handed out their key again (their free
    /// went around the table).
    pub stale_replaced: u64,
    /// Region frees the device refused (the region stayed charged).
    pub region_free_failures: u64,
}

/// A sub-allocation described as a table entry (it has none: its region holds it).
fn sub_entry(rid: usize, slot: &RegionSlot, start: u32, requested: u32, shift: u32) -> Allocation {
    let count = chunks_for(requested, shift);
    Allocation {
        kind: AllocationKind::SubAllocated,
        key: slot.region.address_of(start).0,
        device: slot.device,
        context: slot.context,
        requested: u64::from(requested),
        accounted: 0,
        placement: Placement::Chunks {
            region: rid,
            start,
            count,
        },
    }
}

#[derive(Debug)]
struct RegionSlot {
    region: Region,
    device: DeviceIndex,
    context: ContextId,
}

impl RegionSlot {
    /// Bytes the region holds from the device (and is charged).
    fn bytes(&self, chunk_shift: u32) -> u64 {
        u64::from(self.region.chunks()) << chunk_shift
    }
}

#[derive(Debug, Default)]
struct Pool {
    regions: Vec<usize>,
    current: usize,
}

#[derive(Debug, Default)]
struct State {
    table: AllocationTable,
    regions: slab::Slab<RegionSlot>,
    /// Region base address -> slot, sorted by base, to find the region of any address
    /// (a binary search over a few entries: a handful of growing regions, then one per
    /// 128 MiB in use).
    region_bases: Vec<(u64, usize)>,
    pools: IdHashMap<(DeviceIndex, ContextId), Pool>,
    stale_replaced: u64,
    region_free_failures: u64,
}

impl State {
    fn add_region(&mut self, slot: RegionSlot) -> usize {
        let base = slot.region.base().0;
        let rid = self.regions.insert(slot);
        let at = self.region_bases.partition_point(|&(b, _)| b < base);
        self.region_bases.insert(at, (base, rid));
        rid
    }

    fn take_region(&mut self, rid: usize) -> Option<RegionSlot> {
        let slot = self.regions.try_remove(rid)?;
        let base = slot.region.base().0;
        if let Ok(at) = self.region_bases.binary_search_by_key(&base, |&(b, _)| b) {
            self.region_bases.remove(at);
        }
        Some(slot)
    }

    /// The region whose memory contains `addr`, with its slot id and `addr`'s chunk.
    #[inline]
    fn region_at(&self, addr: u64, chunk_shift: u32) -> Option<(usize, &RegionSlot, u32)> {
        let at = self.region_bases.partition_point(|&(b, _)| b <= addr);
        let &(base, rid) = self.region_bases.get(at.checked_sub(1)?)?;
        let slot = self.regions.get(rid)?;
        slot.region
            .contains(DevicePtr(addr))
            .then(|| (rid, slot, ((addr - base) >> chunk_shift) as u32))
    }

    /// The sub-allocation whose first byte is `addr`, as a table-style entry.
    fn suballocation_at(&self, addr: u64, chunk_shift: u32) -> Option<Allocation> {
        let (rid, slot, chunk) = self.region_at(addr, chunk_shift)?;
        if slot.region.address_of(chunk).0 != addr {
            return None;
        }
        let requested = slot.region.requested_at(chunk)?;
        Some(sub_entry(rid, slot, chunk, requested, chunk_shift))
    }

    /// Live sub-allocations in all regions (diagnostics).
    fn suballocations(&self, chunk_shift: u32) -> impl Iterator<Item = Allocation> + '_ {
        self.regions.iter().flat_map(move |(rid, slot)| {
            slot.region
                .sized_runs()
                .map(move |(start, req)| sub_entry(rid, slot, start, req, chunk_shift))
        })
    }

    /// Detach `rid` from its pool if it is empty and the pool already has another
    /// empty region (keep at most one warm per context). Inline for the common case, a
    /// region still in use after the free; the pool scan is out of line.
    #[inline]
    fn detach_if_surplus(&mut self, rid: usize) -> Option<RegionSlot> {
        if !self.regions.get(rid)?.region.is_empty() {
            return None;
        }
        self.detach_empty_surplus(rid)
    }

    #[cold]
    fn detach_empty_surplus(&mut self, rid: usize) -> Option<RegionSlot> {
        let slot = self.regions.get(rid)?;
        let key = (slot.device, slot.context);
        let pool = self.pools.get_mut(&key)?;
        let regions = &self.regions;
        let other_empty = pool
            .regions
            .iter()
            .any(|&r| r != rid && regions.get(r).is_some_and(|s| s.region.is_empty()));
        if !other_empty {
            return None;
        }
        pool.regions.retain(|&r| r != rid);
        pool.current = 0;
        self.take_region(rid)
    }

    /// Detach every empty region (of `device`, or all), for eviction under pressure.
    fn detach_empty(&mut self, device: Option<DeviceIndex>) -> Vec<RegionSlot> {
        let mut victims = Vec::new();
        for (&(d, _), pool) in self.pools.iter_mut() {
            if device.is_some_and(|want| want != d) {
                continue;
            }
            let regions = &self.regions;
            pool.regions.retain(|&r| {
                let empty = regions.get(r).is_some_and(|s| s.region.is_empty());
                if empty {
                    victims.push(r);
                }
                !empty
            });
            pool.current = 0;
        }
        self.pools.retain(|_, p| !p.regions.is_empty());
        victims
            .into_iter()
            .filter_map(|r| self.take_region(r))
            .collect()
    }

    /// Add a region to its pool; returns its slot.
    fn attach(&mut self, slot: RegionSlot) -> usize {
        let key = (slot.device, slot.context);
        let rid = self.add_region(slot);
        self.pools.entry(key).or_default().regions.push(rid);
        rid
    }
}

/// The allocator of one process: regions, table and decisions over a device backend
/// and a usage ledger. `Send + Sync`; share it behind a `static` or an `Arc`.
#[derive(Debug)]
pub struct Allocator<B: DeviceBackend, L: UsageLedger> {
    backend: B,
    ledger: L,
    config: AllocatorConfig,
    chunk_shift: u32,
    /// Chunks of the longest possible sub-allocation.
    max_run_chunks: u32,
    state: Mutex<State>,
}

/// Allocator sizes that do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid allocator configuration: {0}")]
pub struct InvalidAllocatorConfig(pub String);

impl<B: DeviceBackend, L: UsageLedger> Allocator<B, L> {
    /// An allocator with `config`'s sizes over `backend`, charging `ledger`.
    pub fn new(
        config: AllocatorConfig,
        backend: B,
        ledger: L,
    ) -> Result<Self, InvalidAllocatorConfig> {
        config.validate().map_err(InvalidAllocatorConfig)?;
        Ok(Self {
            backend,
            ledger,
            chunk_shift: config.chunk_size.trailing_zeros(),
            max_run_chunks: config.suballoc_threshold.div_ceil(config.chunk_size) as u32,
            config,
            state: Mutex::new(State::default()),
        })
    }

    /// The sizes in use.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// The device backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The usage ledger.
    pub fn ledger(&self) -> &L {
        &self.ledger
    }

    /// The ledger's usage and limit of `device`.
    pub fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        self.ledger.usage(device)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; if one ever did, the state is still
        // structurally valid, and the hook must keep working rather than abort.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserve `bytes` of `class` on `device`; when the limit refuses, first give warm
    /// empty regions of that device back and try once more. For usage the hook charges
    /// without a table entry.
    pub fn reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<Reservation<'_>, OutOfMemory> {
        match Reservation::new(&self.ledger, device, class, bytes) {
            Ok(r) => Ok(r),
            Err(oom) => {
                if self.evict_empty_regions(Some(device)) == 0 {
                    return Err(oom);
                }
                Reservation::new(&self.ledger, device, class, bytes)
            }
        }
    }

    /// Allocate `bytes` of device memory in `context` (`cuMemAlloc`).
    ///
    /// Below the sub-allocation threshold the request is served in whole chunks from a
    /// region of this context (creating one if needed); otherwise, or when a new region
    /// would not fit the limit or the device, it goes straight to the device.
    pub fn allocate(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u64,
    ) -> Result<Allocated, AllocError> {
        if bytes == 0 {
            return Err(AllocError::InvalidValue("zero-byte allocation"));
        }
        if !self.ledger.has_device(device) {
            return Err(AllocError::InvalidValue("device index out of range"));
        }
        if self.config.suballoc && bytes < self.config.suballoc_threshold {
            // Cannot truncate: bytes < threshold <= 4 GiB (checked by the config).
            let bytes = bytes as u32;
            if let Some(done) = self.suballoc_existing(device, context, bytes) {
                return Ok(done);
            }
            if let Some(done) = self.suballoc_new_region(device, context, bytes)? {
                return Ok(done);
            }
            // The region did not fit the limit or the device: fall through to direct.
        }
        self.allocate_direct(device, context, bytes)
    }

    /// Serve `bytes` from an existing region of the context. The region's bitmap and
    /// size array are the whole record: no table entry, so a burst of small allocations
    /// grows nothing but bits.
    fn suballoc_existing(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u32,
    ) -> Option<Allocated> {
        let count = chunks_for(bytes, self.chunk_shift);
        let mut st = self.lock();
        let st = &mut *st;
        let pool = st.pools.get_mut(&(device, context))?;
        let n = pool.regions.len();
        // `current` < n (every change to the pool resets or sets it): a compare, not a
        // division (tens of cycles), wraps the index.
        let from = pool.current.min(n.saturating_sub(1));
        for k in 0..n {
            let i = if from + k < n { from + k } else { from + k - n };
            let rid = pool.regions[i];
            // A pool never names a missing region (they leave together); skip if it did.
            let Some(slot) = st.regions.get_mut(rid) else {
                continue;
            };
            if slot.region.free_chunks() < count {
                continue;
            }
            if let Some(start) = slot.region.allocate_sized(bytes) {
                pool.current = i;
                return Some(Allocated {
                    ptr: slot.region.address_of(start),
                    kind: AllocationKind::SubAllocated,
                    accounted: u64::from(count) << self.chunk_shift,
                });
            }
        }
        None
    }

    /// Bytes of a new region for a request of `bytes` in `(device, context)`, or `None`
    /// when not even one that holds the request fits the limit. Regions grow with use and
    /// shrink to the limit: the first of a context is one page (the threshold rounded up
    /// to ALIGN), each next one doubles the largest the context holds, up to OVERSIZE; and
    /// none is larger than what remains under the limit. So the memory held but not yet
    /// used stays below what the context already uses (plus one page), and small requests
    /// can fill a limit to within one page. Cold: runs once per region.
    #[cold]
    fn new_region_size(&self, device: DeviceIndex, context: ContextId, bytes: u32) -> Option<u64> {
        let cfg = &self.config;
        // Whole pages (the driver's granularity), and whole chunks.
        let page = cfg.align.max(cfg.chunk_size);
        let chunked = u64::from(chunks_for(bytes, self.chunk_shift)) << self.chunk_shift;
        let need = chunked.next_multiple_of(page).min(cfg.region_size);
        let first = cfg
            .suballoc_threshold
            .next_multiple_of(page)
            .min(cfg.region_size);
        let largest = {
            let st = self.lock();
            st.pools.get(&(device, context)).map_or(0, |pool| {
                pool.regions
                    .iter()
                    .filter_map(|&r| st.regions.get(r))
                    .map(|slot| slot.bytes(self.chunk_shift))
                    .max()
                    .unwrap_or(0)
            })
        };
        let want = largest
            .saturating_mul(2)
            .clamp(first, cfg.region_size)
            .max(need);
        let room = |usage: DeviceUsage| {
            usage.limit.map_or(u64::MAX, |l| {
                let left = l.saturating_sub(usage.used);
                left - left % page
            })
        };
        let mut left = room(self.ledger.usage(device));
        if left < need && self.evict_empty_regions(Some(device)) > 0 {
            left = room(self.ledger.usage(device));
        }
        (left >= need).then(|| want.min(left))
    }

    fn suballoc_new_region(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u32,
    ) -> Result<Option<Allocated>, AllocError> {
        let Some(size) = self.new_region_size(device, context, bytes) else {
            return Ok(None);
        };
        let Ok(reservation) = self.reserve(device, UsageClass::Data, size) else {
            return Ok(None);
        };
        let Ok(base) = self.backend.allocate(device, context, size) else {
            // The device cannot give the region; a direct allocation may still fit.
            return Ok(None);
        };
        // Cannot truncate: size <= OVERSIZE, whose chunk count fits u32 (checked by the
        // config), and size is a whole number of chunks.
        let mut region = Region::new(base, self.chunk_shift, (size >> self.chunk_shift) as u32);
        let Some(start) = region.allocate_sized(bytes) else {
            drop(reservation);
            let _ = self.backend.free(device, context, base);
            return Err(AllocError::Internal(
                "a new region cannot hold a sub-threshold request",
            ));
        };
        let mut st = self.lock();
        let rid = st.attach(RegionSlot {
            region,
            device,
            context,
        });
        if let Some(pool) = st.pools.get_mut(&(device, context)) {
            // Serve the next requests from the new region first.
            pool.current = pool.regions.len() - 1;
        }
        // The region now owns its bytes; they go back when the region does.
        reservation.commit();
        let ptr = st
            .regions
            .get(rid)
            .map(|slot| slot.region.address_of(start))
            .ok_or(AllocError::Internal("region vanished under the lock"))?;
        Ok(Some(Allocated {
            ptr,
            kind: AllocationKind::SubAllocated,
            accounted: u64::from(chunks_for(bytes, self.chunk_shift)) << self.chunk_shift,
        }))
    }

    fn allocate_direct(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u64,
    ) -> Result<Allocated, AllocError> {
        let accounted = bytes
            .checked_next_multiple_of(self.config.align)
            .ok_or(AllocError::SizeOverflow { requested: bytes })?;
        let reservation = self.reserve(device, UsageClass::Data, accounted)?;
        let ptr = self.backend.allocate(device, context, bytes)?;
        let entry = Allocation {
            kind: AllocationKind::Direct,
            key: ptr.0,
            device,
            context,
            requested: bytes,
            accounted,
            placement: Placement::Own,
        };
        let mut st = self.lock();
        match self.insert_entry(&mut st, entry) {
            Ok(_) => {
                reservation.commit();
                Ok(Allocated {
                    ptr,
                    kind: AllocationKind::Direct,
                    accounted,
                })
            }
            Err(e) => {
                drop(st);
                let _ = self.backend.free(device, context, ptr);
                Err(e)
            }
        }
    }

    /// Insert, replacing a stale entry with the same key: the driver just handed the key
    /// out again, so whatever the table held under it was freed behind our back.
    fn insert_entry(&self, st: &mut State, entry: Allocation) -> Result<AllocId, AllocError> {
        if entry.kind.is_address() && st.region_at(entry.key, self.chunk_shift).is_some() {
            // The driver handed out an address inside one of our regions: it cannot,
            // unless the regions are corrupt.
            return Err(AllocError::Internal(
                "new allocation overlaps a sub-allocator region",
            ));
        }
        if let Ok(id) = st.table.insert(entry) {
            return Ok(id);
        }
        let old = if entry.kind.is_address() {
            st.table.remove_address(entry.ptr())
        } else {
            st.table.remove_handle(entry.kind, entry.key)
        };
        match old {
            Some(old) if old.placement == Placement::Own => {
                self.ledger
                    .release(old.device, old.kind.usage_class(), old.accounted);
                st.stale_replaced += 1;
            }
            Some(old) => {
                // Only allocations with their own placement are in the table.
                let _ = st.table.insert(old);
                return Err(AllocError::Internal("table holds a sub-allocation"));
            }
            None => return Err(AllocError::Internal("duplicate key not found")),
        }
        st.table
            .insert(entry)
            .map_err(|_| AllocError::Internal("duplicate key after removal"))
    }

    /// Free the allocation whose base is `ptr` (`cuMemFree`), whatever made it, and
    /// release what it was charged. `NotTracked` means the hook should pass the call to
    /// the driver unchanged (the driver then answers as it would without vgpu).
    pub fn free(&self, ptr: DevicePtr) -> Result<Freed, FreeError> {
        let st = self.lock();
        if let Some((rid, _, chunk)) = st.region_at(ptr.0, self.chunk_shift) {
            return self.free_suballocation(st, ptr, rid, chunk);
        }
        let mut st = st;
        let entry = st.table.remove_address(ptr).ok_or(FreeError::NotTracked)?;
        self.finish_removal(st, entry, true)
    }

    /// Free the sub-allocation whose base is `ptr` (`NotTracked` for any other address in
    /// a region: free space, an interior pointer, a double free). Gives the region back
    /// when it was the last run and another empty region is kept warm.
    #[inline]
    fn free_suballocation(
        &self,
        mut st: MutexGuard<'_, State>,
        ptr: DevicePtr,
        region: usize,
        chunk: u32,
    ) -> Result<Freed, FreeError> {
        let shift = self.chunk_shift;
        let Some(slot) = st.regions.get_mut(region) else {
            return Err(FreeError::Internal("region vanished under the lock"));
        };
        if slot.region.address_of(chunk) != ptr {
            return Err(FreeError::NotTracked); // inside a chunk: not an allocation's base
        }
        // Not the start of a live run: free space, an interior chunk, a double free.
        if slot.region.requested_at(chunk).is_none() {
            return Err(FreeError::NotTracked);
        }
        let (requested, _) = slot
            .region
            .free_sized(chunk)
            .map_err(|_| FreeError::Internal("sub-allocation chunks were not in use"))?;
        let entry = sub_entry(region, slot, chunk, requested, shift);
        let surplus = st.detach_if_surplus(region);
        drop(st);
        let released = match surplus {
            Some(slot) => self.free_region(slot),
            None => 0,
        };
        Ok(Freed {
            allocation: entry,
            released,
        })
    }

    /// Remove `(kind, key)` and release its charge without calling the device, for
    /// allocations the hook frees itself (`cuMemFreeAsync`, `cuArrayDestroy`,
    /// `cuMemRelease`, `cuModuleUnload`), after the driver freed them. Sub-allocated
    /// chunks go back to their region.
    pub fn release_record(&self, kind: AllocationKind, key: u64) -> Result<Freed, FreeError> {
        let mut st = self.lock();
        if kind == AllocationKind::SubAllocated {
            let Some((rid, _, chunk)) = st.region_at(key, self.chunk_shift) else {
                return Err(FreeError::NotTracked);
            };
            return self.free_suballocation(st, DevicePtr(key), rid, chunk);
        }
        let entry = st.table.remove(kind, key).ok_or(FreeError::NotTracked)?;
        self.finish_removal(st, entry, false)
    }

    fn finish_removal(
        &self,
        mut st: MutexGuard<'_, State>,
        entry: Allocation,
        call_device: bool,
    ) -> Result<Freed, FreeError> {
        match entry.placement {
            Placement::Chunks { .. } => {
                // Only allocations with their own placement are in the table.
                let _ = st.table.insert(entry);
                Err(FreeError::Internal("table holds a sub-allocation"))
            }
            Placement::Own => {
                drop(st);
                if call_device {
                    if let Err(e) = self.backend.free(entry.device, entry.context, entry.ptr()) {
                        let mut st = self.lock();
                        if st.table.insert(entry).is_err() {
                            // The driver reused the address meanwhile: ours is gone.
                            self.ledger.release(
                                entry.device,
                                entry.kind.usage_class(),
                                entry.accounted,
                            );
                        }
                        return Err(FreeError::Backend(e));
                    }
                }
                self.ledger
                    .release(entry.device, entry.kind.usage_class(), entry.accounted);
                Ok(Freed {
                    allocation: entry,
                    released: entry.accounted,
                })
            }
        }
    }

    /// Give a detached region back to the device and its bytes to the ledger; if the
    /// device refuses, re-attach it so its bytes stay charged. Returns bytes released.
    fn free_region(&self, slot: RegionSlot) -> u64 {
        match self
            .backend
            .free(slot.device, slot.context, slot.region.base())
        {
            Ok(()) => {
                let bytes = slot.bytes(self.chunk_shift);
                self.ledger.release(slot.device, UsageClass::Data, bytes);
                bytes
            }
            Err(_) => {
                let mut st = self.lock();
                st.region_free_failures += 1;
                let _ = st.attach(slot);
                0
            }
        }
    }

    fn evict_empty_regions(&self, device: Option<DeviceIndex>) -> usize {
        let victims = self.lock().detach_empty(device);
        victims
            .into_iter()
            .map(|slot| self.free_region(slot))
            .filter(|&b| b > 0)
            .count()
    }

    /// Give every warm empty region back to the device (all devices). Returns how many.
    pub fn trim(&self) -> usize {
        self.evict_empty_regions(None)
    }

    /// Reserve for an allocation the hook performs itself (managed, pitched, async,
    /// VMM handle, array, graph, context, module): the charge is taken now; call the
    /// driver, then [`PendingRecord::commit`] with the key it returned. Dropping the
    /// pending record (driver failed) gives the charge back.
    pub fn begin_record(
        &self,
        kind: AllocationKind,
        device: DeviceIndex,
        context: ContextId,
        requested: u64,
        accounted: u64,
    ) -> Result<PendingRecord<'_, B, L>, AllocError> {
        if kind == AllocationKind::SubAllocated {
            return Err(AllocError::InvalidValue(
                "sub-allocations are made by allocate()",
            ));
        }
        if !self.ledger.has_device(device) {
            return Err(AllocError::InvalidValue("device index out of range"));
        }
        let reservation = self.reserve(device, kind.usage_class(), accounted)?;
        Ok(PendingRecord {
            allocator: self,
            reservation,
            kind,
            device,
            context,
            requested,
        })
    }

    /// The address allocation containing `addr` (`cuMemGetAddressRange`); `None` when
    /// untracked, including free space inside a region. Logarithmic: one range query
    /// among allocations with their own driver allocation, else one among regions and a
    /// bounded bitmap scan inside the region.
    pub fn containing(&self, addr: DevicePtr) -> Option<AddressRange> {
        let st = self.lock();
        let a = match st.region_at(addr.0, self.chunk_shift) {
            Some((_, slot, chunk)) => {
                let region = &slot.region;
                let start = region.run_start_at_or_before(chunk, self.max_run_chunks)?;
                let a = st.suballocation_at(region.address_of(start).0, self.chunk_shift)?;
                if addr.0 - a.key >= a.requested.max(1) {
                    return None;
                }
                a
            }
            None => *st.table.containing(addr)?.1,
        };
        Some(AddressRange {
            base: a.ptr(),
            size: a.requested,
            kind: a.kind,
            device: a.device,
            context: a.context,
        })
    }

    /// The entry `(kind, key)`, if tracked.
    pub fn lookup(&self, kind: AllocationKind, key: u64) -> Option<Allocation> {
        let st = self.lock();
        if kind == AllocationKind::SubAllocated {
            st.suballocation_at(key, self.chunk_shift)
        } else if kind.is_address() {
            st.table
                .get_address(DevicePtr(key))
                .map(|(_, a)| *a)
                .filter(|a| a.kind == kind)
        } else {
            st.table.get_handle(kind, key).map(|(_, a)| *a)
        }
    }

    /// `context` was destroyed: the driver freed its memory, so drop its regions and
    /// entries and release their charge, without calling the device.
    pub fn release_context(&self, context: ContextId) -> ContextReleased {
        let (entries, regions) = {
            let mut st = self.lock();
            let st = &mut *st;
            let mut entries = st.table.drain_context(context);
            let mut rids = Vec::new();
            st.pools.retain(|&(_, c), pool| {
                if c == context {
                    rids.extend_from_slice(&pool.regions);
                }
                c != context
            });
            // Their sub-allocations go with them (reported, nothing more to release).
            for &rid in &rids {
                if let Some(slot) = st.regions.get(rid) {
                    let shift = self.chunk_shift;
                    entries.extend(
                        slot.region
                            .sized_runs()
                            .map(|(start, req)| sub_entry(rid, slot, start, req, shift)),
                    );
                }
            }
            let regions: Vec<RegionSlot> =
                rids.into_iter().filter_map(|r| st.take_region(r)).collect();
            (entries, regions)
        };
        let mut out = ContextReleased {
            allocations: entries.len(),
            regions: regions.len(),
            released: 0,
        };
        for e in entries.iter().filter(|e| e.placement == Placement::Own) {
            self.ledger
                .release(e.device, e.kind.usage_class(), e.accounted);
            out.released += e.accounted;
        }
        for slot in &regions {
            let bytes = slot.bytes(self.chunk_shift);
            self.ledger.release(slot.device, UsageClass::Data, bytes);
            out.released += bytes;
        }
        out
    }

    /// Counters.
    pub fn stats(&self) -> AllocatorStats {
        let st = self.lock();
        AllocatorStats {
            live_allocations: st.table.len()
                + st.regions
                    .iter()
                    .map(|(_, s)| s.region.live_runs())
                    .sum::<usize>(),
            regions: st.regions.len(),
            empty_regions: st
                .regions
                .iter()
                .filter(|(_, s)| s.region.is_empty())
                .count(),
            stale_replaced: st.stale_replaced,
            region_free_failures: st.region_free_failures,
        }
    }

    /// The region whose memory contains `addr`, if any (O(log regions), no allocation):
    /// an untracked address inside a region is a double free or an interior pointer, which
    /// must not reach the driver.
    pub fn region_containing(&self, addr: DevicePtr) -> Option<RegionInfo> {
        let st = self.lock();
        let (_, s, _) = st.region_at(addr.0, self.chunk_shift)?;
        Some(RegionInfo {
            device: s.device,
            context: s.context,
            base: s.region.base(),
            chunks: s.region.chunks(),
            free_chunks: s.region.free_chunks(),
        })
    }

    /// Every region held (tests, diagnostics; O(regions)).
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.lock()
            .regions
            .iter()
            .map(|(_, s)| RegionInfo {
                device: s.device,
                context: s.context,
                base: s.region.base(),
                chunks: s.region.chunks(),
                free_chunks: s.region.free_chunks(),
            })
            .collect()
    }

    /// A copy of every live entry (tests, diagnostics; O(n)).
    pub fn snapshot(&self) -> Vec<Allocation> {
        let st = self.lock();
        st.table
            .iter()
            .map(|(_, a)| *a)
            .chain(st.suballocations(self.chunk_shift))
            .collect()
    }
}

/// A charge taken for an allocation the hook is about to make (see
/// [`Allocator::begin_record`]).
#[derive(Debug)]
#[must_use = "dropping a pending record gives its charge back; commit() once the driver succeeded"]
pub struct PendingRecord<'a, B: DeviceBackend, L: UsageLedger> {
    allocator: &'a Allocator<B, L>,
    reservation: Reservation<'a>,
    kind: AllocationKind,
    device: DeviceIndex,
    context: ContextId,
    requested: u64,
}

impl<B: DeviceBackend, L: UsageLedger> PendingRecord<'_, B, L> {
    /// Bytes charged.
    pub fn accounted(&self) -> u64 {
        self.reservation.bytes()
    }

    /// Change the charge to `accounted` (e.g. a pitched allocation's estimate corrected
    /// with the real pitch) without holding two charges at once. Growing may give warm
    /// empty regions back first, like any reservation.
    pub fn resize(&mut self, accounted: u64) -> Result<(), AllocError> {
        match self.reservation.resize(accounted) {
            Ok(()) => Ok(()),
            Err(oom) => {
                if self.allocator.evict_empty_regions(Some(self.device)) == 0 {
                    return Err(oom.into());
                }
                self.reservation.resize(accounted).map_err(Into::into)
            }
        }
    }

    /// The driver succeeded and returned `key` (address or handle): track it.
    pub fn commit(self, key: u64) -> Result<AllocId, AllocError> {
        let entry = Allocation {
            kind: self.kind,
            key,
            device: self.device,
            context: self.context,
            requested: self.requested,
            accounted: self.reservation.bytes(),
            placement: Placement::Own,
        };
        let mut st = self.allocator.lock();
        let id = self.allocator.insert_entry(&mut st, entry)?;
        self.reservation.commit();
        Ok(id)
    }
}
