//! Random operation sequences driven through [`Allocator`] and checked against a simple
//! model after every step. Used by the `alloc_ops` fuzz target (`cargo fuzz run -s none
//! alloc_ops`), by proptest state-machine tests, and by a unit test on random bytes, so
//! CI exercises the same checks without cargo-fuzz.
//!
//! Checked after every step: ledger usage equals the model's (direct and recorded
//! charges plus whole regions, the regions counted independently by the mock device);
//! the device holds exactly the model's allocations plus the regions; usage never
//! exceeds a limit; no two allocations or regions overlap; every sub-allocation is
//! chunk-aligned and lies in a region of its own device and context, and each region's
//! used chunks are exactly its sub-allocations'; at most one empty region per context.
//! Checked per operation: the path taken (sub-allocation below the threshold, direct
//! only when the device refused a region), the size of every new region (one page first,
//! then double the largest of its context up to OVERSIZE, cut only to what remains under
//! the limit), accounted sizes, that an out-of-memory would also have refused a direct
//! allocation, address lookups, and frees. At the end, the "everything returned" oracle: after freeing
//! everything, a request of each device's full limit succeeds, and after `trim` no
//! region, no charge and no device allocation remain.

use std::collections::HashMap;
use std::fmt;

use crate::allocator::{AllocError, Allocator, FreeError};
use crate::backend::{ContextId, DeviceBackend, DevicePtr};
use crate::ledger::{DeviceIndex, InMemoryLedger, UsageLedger};
use crate::mock::MockBackend;
use crate::table::AllocationKind;
use crate::tuning::AllocatorConfig;

/// Devices the harness uses.
pub const DEVICES: usize = 4;
/// Contexts the harness uses (ids 0..CONTEXTS).
pub const CONTEXTS: u8 = 3;

const RECORD_KINDS: [AllocationKind; 9] = [
    AllocationKind::Managed,
    AllocationKind::Pitched,
    AllocationKind::PoolAsync,
    AllocationKind::VmmHandle,
    AllocationKind::Array,
    AllocationKind::MipmappedArray,
    AllocationKind::Graph,
    AllocationKind::Module,
    AllocationKind::Context,
];

/// Allocator sizes and per-device limits of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarnessConfig {
    /// Sub-allocator sizes.
    pub allocator: AllocatorConfig,
    /// Limits of devices 0..DEVICES (multiples of the alignment, at least the threshold).
    pub limits: [Option<u64>; DEVICES],
}

impl HarnessConfig {
    /// Tiny sizes (regions of 8 KiB growing to 64 KiB, 512-byte chunks, 8 KiB threshold,
    /// 4 KiB alignment) so short sequences fill regions, churn them and hit every limit.
    pub fn small() -> Self {
        Self {
            allocator: AllocatorConfig {
                suballoc: true,
                region_size: 64 << 10,
                chunk_size: 512,
                suballoc_threshold: 8 << 10,
                align: 4 << 10,
            },
            // Device 3's limit is below one full-size region: its regions are cut to fit.
            limits: [Some(1 << 20), Some(256 << 10), None, Some(60 << 10)],
        }
    }

    /// The real defaults (regions of 2 MiB growing to 128 MiB, 512-byte chunks, 2 MiB
    /// threshold and alignment).
    pub fn default_sizes() -> Self {
        Self {
            allocator: AllocatorConfig::default(),
            limits: [Some(1 << 30), Some(300 << 20), None, Some(100 << 20)],
        }
    }

    fn ledger_limits(&self) -> [Option<u64>; DEVICES] {
        self.limits
    }
}

/// One operation; out-of-range fields are reduced modulo their range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `allocate(device, context, size)`.
    Allocate {
        /// Device (mod [`DEVICES`]).
        device: u8,
        /// Context (mod [`CONTEXTS`]).
        context: u8,
        /// Bytes.
        size: u64,
    },
    /// Free the `pick`-th live allocation (mod the number live) the way its kind is freed.
    Free {
        /// Which live allocation.
        pick: u32,
    },
    /// `free` of an address; must be `NotTracked` unless it is a live base.
    FreeUnknown {
        /// The address.
        addr: u64,
    },
    /// An allocation the hook makes itself: reserve, device call, commit.
    Record {
        /// Index into the recordable kinds.
        kind: u8,
        /// Device (mod [`DEVICES`]).
        device: u8,
        /// Context (mod [`CONTEXTS`]).
        context: u8,
        /// Bytes requested.
        requested: u64,
        /// Bytes to charge.
        accounted: u64,
        /// Whether the driver call succeeds.
        driver_ok: bool,
    },
    /// The hook frees the `pick`-th live allocation itself, then `release_record`.
    ReleaseRecord {
        /// Which live allocation.
        pick: u32,
    },
    /// `containing(base + offset)` of the `pick`-th live allocation.
    Containing {
        /// Which live allocation.
        pick: u32,
        /// Offset from its base.
        offset: u64,
    },
    /// `cuCtxDestroy`: the device frees the context's memory, then `release_context`.
    DestroyContext {
        /// Context (mod [`CONTEXTS`]).
        context: u8,
    },
    /// The device's next allocation fails.
    FailNextDeviceAllocation,
    /// `trim()`.
    Trim,
}

/// A broken invariant: which step, which operation, what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Index of the operation (`usize::MAX` for the final oracle).
    pub step: usize,
    /// The operation, formatted.
    pub op: String,
    /// What was wrong.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} ({}): {}", self.step, self.op, self.message)
    }
}

impl std::error::Error for Violation {}

/// What a run exercised, so tests can tell they are not vacuous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    /// Operations run.
    pub steps: usize,
    /// Successful sub-allocations.
    pub sub_allocations: usize,
    /// Successful direct allocations.
    pub direct_allocations: usize,
    /// Small requests that fell back to direct.
    pub fallbacks: usize,
    /// Refusals by the limit.
    pub out_of_memory: usize,
    /// Refusals by the device.
    pub device_errors: usize,
    /// Records committed.
    pub records: usize,
    /// Frees and releases.
    pub frees: usize,
    /// Contexts destroyed.
    pub contexts_destroyed: usize,
}

#[derive(Debug, Clone, Copy)]
struct Live {
    kind: AllocationKind,
    key: u64,
    device: DeviceIndex,
    context: ContextId,
    requested: u64,
    /// Bytes charged to the ledger by this entry itself (0 for sub-allocations).
    accounted: u64,
    /// Bytes occupied at `key` (chunks for sub-allocations).
    span: u64,
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

type Alloc = Allocator<MockBackend, InMemoryLedger>;

struct Harness {
    cfg: HarnessConfig,
    alloc: Alloc,
    live: Vec<Live>,
    next_handle: u64,
    summary: Summary,
}

/// Decode `data` into a configuration and operations, run them, and check every step.
pub fn run_ops(data: &[u8]) -> Result<Summary, Violation> {
    let (cfg, ops) = decode(data);
    run(&cfg, &ops)
}

/// Run `ops` on a fresh allocator of `cfg`, checking the model after every step and the
/// "everything returned" oracle at the end.
pub fn run(cfg: &HarnessConfig, ops: &[Op]) -> Result<Summary, Violation> {
    let alloc = Allocator::new(
        cfg.allocator,
        MockBackend::new(),
        InMemoryLedger::new(cfg.ledger_limits()),
    )
    .map_err(|e| Violation {
        step: 0,
        op: "new".into(),
        message: e.to_string(),
    })?;
    let mut h = Harness {
        cfg: *cfg,
        alloc,
        live: Vec::new(),
        next_handle: 1,
        summary: Summary::default(),
    };
    for (step, op) in ops.iter().enumerate() {
        h.step(op)
            .and_then(|()| h.check())
            .map_err(|message| Violation {
                step,
                op: format!("{op:?}"),
                message,
            })?;
        h.summary.steps += 1;
    }
    h.finish().map_err(|message| Violation {
        step: usize::MAX,
        op: "final oracle".into(),
        message,
    })?;
    Ok(h.summary)
}

impl Harness {
    fn limit(&self, d: DeviceIndex) -> Option<u64> {
        self.cfg.limits[d.as_usize()]
    }

    fn used(&self, d: DeviceIndex) -> u64 {
        self.alloc.ledger().usage(d).used
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Allocate {
                device,
                context,
                size,
            } => self.allocate(dev(device), ctx(context), size),
            Op::Free { pick } => self.free(pick),
            Op::FreeUnknown { addr } => {
                if self
                    .live
                    .iter()
                    .any(|l| l.kind.is_address() && l.key == addr)
                {
                    return Ok(());
                }
                let r = self.alloc.free(DevicePtr(addr));
                ensure!(
                    r == Err(FreeError::NotTracked),
                    "free of untracked {addr:#x} gave {r:?}"
                );
                Ok(())
            }
            Op::Record {
                kind,
                device,
                context,
                requested,
                accounted,
                driver_ok,
            } => {
                let kind = RECORD_KINDS[kind as usize % RECORD_KINDS.len()];
                self.record(
                    kind,
                    dev(device),
                    ctx(context),
                    requested,
                    accounted,
                    driver_ok,
                )
            }
            Op::ReleaseRecord { pick } => self.release_record(pick),
            Op::Containing { pick, offset } => self.containing(pick, offset),
            Op::DestroyContext { context } => self.destroy_context(ctx(context)),
            Op::FailNextDeviceAllocation => {
                self.alloc.backend().fail_next_allocations(1);
                Ok(())
            }
            Op::Trim => {
                self.alloc.trim();
                let s = self.alloc.stats();
                ensure!(
                    s.empty_regions == 0,
                    "trim left {} empty regions",
                    s.empty_regions
                );
                Ok(())
            }
        }
    }

    fn allocate(&mut self, d: DeviceIndex, c: ContextId, size: u64) -> Result<(), String> {
        let a = self.cfg.allocator;
        let failures_before = self.alloc.backend().pending_failures();
        let regions_before = self.alloc.regions();
        let device_used_before = self.alloc.backend().used(d);
        let result = self.alloc.allocate(d, c, size);
        let injected = self.alloc.backend().pending_failures() < failures_before;
        let used = self.used(d);
        let direct_accounted = size.checked_next_multiple_of(a.align);
        let largest_before = regions_before
            .iter()
            .filter(|r| (r.device, r.context) == (d, c))
            .map(|r| u64::from(r.chunks) * a.chunk_size)
            .max();
        match result {
            Ok(r) => {
                ensure!(size > 0, "size 0 was accepted");
                let small = a.suballoc && size < a.suballoc_threshold;
                let span;
                match r.kind {
                    AllocationKind::SubAllocated => {
                        ensure!(small, "{size} bytes sub-allocated");
                        span = size.div_ceil(a.chunk_size) * a.chunk_size;
                        ensure!(
                            r.accounted == span,
                            "sub accounted {} != {span}",
                            r.accounted
                        );
                        ensure!(
                            r.ptr.0 % a.chunk_size == 0,
                            "unaligned sub-allocation {}",
                            r.ptr
                        );
                        self.check_new_region(&regions_before, d, c, size, largest_before)?;
                        self.summary.sub_allocations += 1;
                    }
                    AllocationKind::Direct => {
                        ensure!(
                            Some(r.accounted) == direct_accounted,
                            "direct accounted {}",
                            r.accounted
                        );
                        if small {
                            // A region is cut to what remains, so it fits whenever the
                            // direct allocation does: only a device refusal falls back.
                            ensure!(
                                injected,
                                "fell back to direct although a region fits ({used} used)"
                            );
                            self.summary.fallbacks += 1;
                        }
                        span = size;
                        self.summary.direct_allocations += 1;
                    }
                    other => return Err(format!("allocate returned kind {other:?}")),
                }
                ensure!(
                    !self
                        .live
                        .iter()
                        .any(|l| l.kind.is_address() && l.key == r.ptr.0),
                    "address reused while live"
                );
                let accounted = if r.kind == AllocationKind::Direct {
                    r.accounted
                } else {
                    0
                };
                self.live.push(Live {
                    kind: r.kind,
                    key: r.ptr.0,
                    device: d,
                    context: c,
                    requested: size,
                    accounted,
                    span,
                });
            }
            Err(AllocError::InvalidValue(_)) => {
                ensure!(size == 0, "{size} bytes refused as invalid")
            }
            Err(AllocError::SizeOverflow { requested }) => {
                ensure!(
                    requested == size && direct_accounted.is_none(),
                    "overflow claimed for {size}"
                );
            }
            Err(AllocError::OutOfMemory(oom)) => {
                let limit = self.limit(d);
                ensure!(
                    oom.device == d && oom.limit == limit.unwrap_or(u64::MAX),
                    "bad OOM fields {oom:?}"
                );
                // Refused only if a direct allocation would have been refused too.
                let need = direct_accounted.ok_or("OOM for an overflowing size")?;
                ensure!(
                    used.checked_add(need)
                        .is_none_or(|n| n > limit.unwrap_or(u64::MAX)),
                    "OOM although {need} bytes fit ({used} used, limit {limit:?})"
                );
                self.summary.out_of_memory += 1;
            }
            Err(AllocError::Backend(e)) => {
                let physically_full = size > (1u64 << 50) - device_used_before;
                ensure!(
                    injected || physically_full,
                    "device error {e} without cause"
                );
                self.summary.device_errors += 1;
            }
            Err(e @ AllocError::Internal(_)) => return Err(e.to_string()),
        }
        Ok(())
    }

    /// A region made for a sub-allocation of `size` in `(d, c)` has the size the growth
    /// rule gives: the threshold's page first, then twice the context's largest region, at
    /// most OVERSIZE, at least the request's page; smaller only when it took all that
    /// remained under the limit.
    fn check_new_region(
        &self,
        before: &[crate::RegionInfo],
        d: DeviceIndex,
        c: ContextId,
        size: u64,
        largest_before: Option<u64>,
    ) -> Result<(), String> {
        let a = self.cfg.allocator;
        let page = a.align.max(a.chunk_size);
        let new: Vec<u64> = self
            .alloc
            .regions()
            .iter()
            .filter(|r| (r.device, r.context) == (d, c) && !before.iter().any(|b| b.base == r.base))
            .map(|r| u64::from(r.chunks) * a.chunk_size)
            .collect();
        let &[bytes] = new.as_slice() else {
            ensure!(new.is_empty(), "one sub-allocation made regions {new:?}");
            return Ok(());
        };
        let need = size
            .next_multiple_of(a.chunk_size)
            .next_multiple_of(page)
            .min(a.region_size);
        let first = a
            .suballoc_threshold
            .next_multiple_of(page)
            .min(a.region_size);
        // Empty regions may have been given back to make room: the pool may have shrunk.
        let want = largest_before
            .unwrap_or(0)
            .saturating_mul(2)
            .clamp(first, a.region_size)
            .max(need);
        let left = self
            .limit(d)
            .map_or(u64::MAX, |l| l.saturating_sub(self.used(d)));
        ensure!(
            need <= bytes && bytes <= want && (bytes == want || left < page),
            "new region of {bytes} bytes for {size} (need {need}, want {want}, {left} left)"
        );
        Ok(())
    }

    fn pick(&self, pick: u32) -> Option<usize> {
        (!self.live.is_empty()).then(|| pick as usize % self.live.len())
    }

    fn free(&mut self, pick: u32) -> Result<(), String> {
        let Some(i) = self.pick(pick) else {
            return Ok(());
        };
        let l = self.live[i];
        let r = if l.kind.is_address() {
            self.alloc.free(DevicePtr(l.key))
        } else {
            self.alloc.release_record(l.kind, l.key)
        };
        let freed = r.map_err(|e| format!("free of {l:?} failed: {e}"))?;
        let a = freed.allocation;
        ensure!(
            (a.kind, a.key, a.requested, a.device, a.context)
                == (l.kind, l.key, l.requested, l.device, l.context),
            "freed {a:?}, expected {l:?}"
        );
        ensure!(
            a.kind == AllocationKind::SubAllocated || freed.released == l.accounted,
            "released {}",
            freed.released
        );
        self.live.swap_remove(i);
        self.summary.frees += 1;
        Ok(())
    }

    fn release_record(&mut self, pick: u32) -> Result<(), String> {
        let Some(i) = self.pick(pick) else {
            return Ok(());
        };
        let l = self.live[i];
        if l.kind.is_address() && l.kind != AllocationKind::SubAllocated {
            // The hook calls the driver first (e.g. cuMemFreeAsync), then releases.
            self.alloc
                .backend()
                .free(l.device, l.context, DevicePtr(l.key))
                .map_err(|e| format!("device free of {l:?}: {e}"))?;
        }
        let freed = self
            .alloc
            .release_record(l.kind, l.key)
            .map_err(|e| format!("release of {l:?}: {e}"))?;
        ensure!(
            freed.allocation.key == l.key && freed.allocation.kind == l.kind,
            "released {freed:?}"
        );
        self.live.swap_remove(i);
        self.summary.frees += 1;
        Ok(())
    }

    fn record(
        &mut self,
        kind: AllocationKind,
        d: DeviceIndex,
        c: ContextId,
        requested: u64,
        accounted: u64,
        driver_ok: bool,
    ) -> Result<(), String> {
        // Address kinds get a real device allocation of `requested` bytes from the mock.
        let requested = if kind.is_address() {
            requested.clamp(1, 1 << 40)
        } else {
            requested
        };
        let pending = match self.alloc.begin_record(kind, d, c, requested, accounted) {
            Ok(p) => p,
            Err(AllocError::OutOfMemory(_)) => {
                let l = self.limit(d);
                let after = self.used(d);
                ensure!(
                    after
                        .checked_add(accounted)
                        .is_none_or(|n| n > l.unwrap_or(u64::MAX)),
                    "record OOM although it fits"
                );
                self.summary.out_of_memory += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("begin_record: {e}")),
        };
        ensure!(
            pending.accounted() == accounted,
            "pending charge {}",
            pending.accounted()
        );
        let key = if !driver_ok {
            None
        } else if kind.is_address() {
            self.alloc
                .backend()
                .allocate(d, c, requested)
                .ok()
                .map(|p| p.0)
        } else {
            self.next_handle += 1;
            Some(self.next_handle)
        };
        let Some(key) = key else {
            let before = self.used(d);
            drop(pending);
            ensure!(
                self.used(d) == before - accounted,
                "dropped record kept its charge"
            );
            return Ok(());
        };
        pending.commit(key).map_err(|e| format!("commit: {e}"))?;
        let span = if kind.is_address() { requested } else { 0 };
        self.live.push(Live {
            kind,
            key,
            device: d,
            context: c,
            requested,
            accounted,
            span,
        });
        self.summary.records += 1;
        Ok(())
    }

    fn containing(&mut self, pick: u32, offset: u64) -> Result<(), String> {
        let Some(i) = self.pick(pick) else {
            return Ok(());
        };
        let l = self.live[i];
        if !l.kind.is_address() {
            return Ok(());
        }
        let offset = offset
            % (l.requested
                .saturating_add(2 * self.cfg.allocator.chunk_size));
        let Some(addr) = l.key.checked_add(offset) else {
            return Ok(());
        };
        let r = self.alloc.containing(DevicePtr(addr));
        if offset < l.requested {
            let r = r.ok_or_else(|| format!("{addr:#x} inside {l:?} not found"))?;
            ensure!(
                (r.base.0, r.size, r.kind, r.device, r.context)
                    == (l.key, l.requested, l.kind, l.device, l.context),
                "containing gave {r:?} for {l:?}"
            );
        } else {
            ensure!(
                r.is_none_or(|r| r.base.0 != l.key),
                "{addr:#x} past the end of {l:?} gave {r:?}"
            );
        }
        Ok(())
    }

    fn destroy_context(&mut self, c: ContextId) -> Result<(), String> {
        self.alloc.backend().destroy_context(c);
        let total = |h: &Self| {
            (0..DEVICES)
                .map(|d| h.used(DeviceIndex(d as u32)))
                .sum::<u64>()
        };
        let before = total(self);
        let r = self.alloc.release_context(c);
        ensure!(
            before - total(self) == r.released,
            "release_context reported {} released",
            r.released
        );
        let gone = self.live.iter().filter(|l| l.context == c).count();
        ensure!(
            r.allocations == gone,
            "release_context removed {} entries, model has {gone}",
            r.allocations
        );
        self.live.retain(|l| l.context != c);
        self.summary.contexts_destroyed += 1;
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        let a = self.cfg.allocator;
        let stats = self.alloc.stats();
        ensure!(
            stats.live_allocations == self.live.len(),
            "table has {}, model {}",
            stats.live_allocations,
            self.live.len()
        );
        let regions = self.alloc.regions();
        ensure!(regions.len() == stats.regions, "region count");
        for di in 0..DEVICES {
            let d = DeviceIndex(di as u32);
            let own_address: Vec<&Live> = self
                .live
                .iter()
                .filter(|l| {
                    l.device == d && l.kind.is_address() && l.kind != AllocationKind::SubAllocated
                })
                .collect();
            let (dev_count, dev_bytes) = self.alloc.backend().live_on(d);
            let n_regions = dev_count
                .checked_sub(own_address.len())
                .ok_or_else(|| format!("device {d} has fewer allocations than the model"))?;
            ensure!(
                regions.iter().filter(|r| r.device == d).count() == n_regions,
                "device {d}: {n_regions} regions on the device, allocator reports another count"
            );
            let own_bytes: u64 = own_address.iter().map(|l| l.span).sum();
            let region_bytes: u64 = regions
                .iter()
                .filter(|r| r.device == d)
                .map(|r| u64::from(r.chunks) * a.chunk_size)
                .sum();
            ensure!(
                dev_bytes == own_bytes + region_bytes,
                "device {d} bytes {dev_bytes}"
            );
            let charged: u64 = self
                .live
                .iter()
                .filter(|l| l.device == d)
                .map(|l| l.accounted)
                .sum();
            let want = charged + region_bytes;
            let used = self.used(d);
            ensure!(used == want, "device {d}: ledger {used}, model {want}");
            if let Some(l) = self.limit(d) {
                ensure!(used <= l, "device {d}: {used} over limit {l}");
            }
        }
        // At most one empty region per (device, context).
        let mut empties: HashMap<(DeviceIndex, ContextId), usize> = HashMap::new();
        for r in regions.iter().filter(|r| r.free_chunks == r.chunks) {
            *empties.entry((r.device, r.context)).or_default() += 1;
        }
        ensure!(
            empties.values().all(|&n| n <= 1),
            "more than one empty region per context: {empties:?}"
        );
        // No overlap between own allocations and regions.
        let mut spans: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter(|l| l.kind.is_address() && l.kind != AllocationKind::SubAllocated)
            .map(|l| (l.key, l.span))
            .chain(
                regions
                    .iter()
                    .map(|r| (r.base.0, u64::from(r.chunks) * a.chunk_size)),
            )
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            ensure!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
        }
        // Sub-allocations: inside a region of their own device and context, disjoint, and
        // each region's used chunks are exactly theirs.
        let mut used_chunks = vec![0u64; regions.len()];
        let mut subs: Vec<&Live> = self
            .live
            .iter()
            .filter(|l| l.kind == AllocationKind::SubAllocated)
            .collect();
        subs.sort_unstable_by_key(|l| l.key);
        for w in subs.windows(2) {
            ensure!(w[0].key + w[0].span <= w[1].key, "sub-allocations overlap");
        }
        for l in subs {
            ensure!(l.key % a.chunk_size == 0, "unaligned {l:?}");
            let (ri, r) = regions
                .iter()
                .enumerate()
                .find(|(_, r)| {
                    l.key >= r.base.0
                        && l.key + l.span <= r.base.0 + u64::from(r.chunks) * a.chunk_size
                })
                .ok_or_else(|| format!("{l:?} outside every region"))?;
            ensure!(
                (r.device, r.context) == (l.device, l.context),
                "{l:?} in a region of {:?}",
                (r.device, r.context)
            );
            used_chunks[ri] += l.span / a.chunk_size;
        }
        for (r, used) in regions.iter().zip(used_chunks) {
            ensure!(
                u64::from(r.chunks - r.free_chunks) == used,
                "region {} uses {} chunks, model {used}",
                r.base,
                r.chunks - r.free_chunks
            );
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), String> {
        while !self.live.is_empty() {
            self.free(0)?;
        }
        self.check()?;
        let a = self.cfg.allocator;
        // An injected device failure left unconsumed is not part of the oracle.
        self.alloc.backend().fail_next_allocations(0);
        for di in 0..DEVICES {
            let d = DeviceIndex(di as u32);
            // Warm regions must never stand in the way of a full-size request.
            let full = self.limit(d).unwrap_or(4 * a.region_size);
            let r = self.alloc.allocate(d, ContextId(0), full).map_err(|e| {
                format!("full-size request of {full} on device {d} after freeing all: {e}")
            })?;
            self.alloc.free(r.ptr).map_err(|e| e.to_string())?;
        }
        self.alloc.trim();
        let s = self.alloc.stats();
        ensure!(
            s.regions == 0 && s.live_allocations == 0,
            "left behind: {s:?}"
        );
        for di in 0..DEVICES {
            let d = DeviceIndex(di as u32);
            ensure!(
                self.used(d) == 0,
                "device {d} still charged {}",
                self.used(d)
            );
        }
        ensure!(
            self.alloc.backend().live_allocations() == 0,
            "device allocations leaked"
        );
        Ok(())
    }
}

fn dev(d: u8) -> DeviceIndex {
    DeviceIndex(u32::from(d) % DEVICES as u32)
}

fn ctx(c: u8) -> ContextId {
    ContextId(u64::from(c % CONTEXTS))
}

/// Sizes worth trying for `cfg`: the edges around every threshold, then random ones.
pub fn edge_sizes(cfg: &HarnessConfig) -> Vec<u64> {
    let a = cfg.allocator;
    let t = a.suballoc_threshold;
    let r = a.region_size;
    let mut v = vec![
        0,
        1,
        a.chunk_size - 1,
        a.chunk_size,
        a.chunk_size + 1,
        t - 1,
        t,
        t + 1,
        r - 1,
        r,
        r + 1,
        u64::MAX,
        u64::MAX - a.align + 2,
        u64::MAX - 2 * a.align,
        (1 << 50) + 1,
    ];
    v.extend(
        cfg.limits
            .iter()
            .flatten()
            .flat_map(|&l| [l, l + 1, l - a.align]),
    );
    v
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn more(&self) -> bool {
        self.pos < self.data.len()
    }
}

/// Turn bytes into a configuration (first byte: small or default sizes, sub-allocation
/// on or off) and a sequence of operations.
pub fn decode(data: &[u8]) -> (HarnessConfig, Vec<Op>) {
    let mut c = Cursor { data, pos: 0 };
    let sel = c.u8();
    let mut cfg = if sel & 1 == 0 {
        HarnessConfig::small()
    } else {
        HarnessConfig::default_sizes()
    };
    cfg.allocator.suballoc = sel & 6 != 6; // off one time in four
    let edges = edge_sizes(&cfg);
    let a = cfg.allocator;
    let size = |c: &mut Cursor<'_>| -> u64 {
        let s = c.u8();
        let v = u64::from(c.u32());
        // Mostly sub-threshold sizes so pools grow several regions deep; some around the
        // threshold, some large, some edges.
        let t = a.suballoc_threshold;
        match s % 8 {
            0 => edges[v as usize % edges.len()],
            1..=3 => 1 + v % t,
            4 | 5 => 1 + v % (t / 8),
            6 => 1 + v % (t + t / 2),
            _ => 1 + v % (2 * a.region_size),
        }
    };
    let mut ops = Vec::new();
    while c.more() && ops.len() < 4096 {
        let op = match c.u8() % 16 {
            0..=6 => {
                // Half the traffic goes to device 0, context 0 so its pool grows several
                // regions deep; the rest spreads over every device and context.
                let b = c.u8();
                let (device, context) = if b & 0x80 == 0 { (0, 0) } else { (b, b >> 2) };
                Op::Allocate {
                    device,
                    context,
                    size: size(&mut c),
                }
            }
            7..=9 => Op::Free { pick: c.u32() },
            10 => Op::FreeUnknown {
                addr: u64::from(c.u32()) << 9,
            },
            11 => {
                let (kind, device, context) = (c.u8(), c.u8(), c.u8());
                let requested = size(&mut c) % (4 * a.region_size);
                let accounted = size(&mut c) % (a.region_size + 1);
                Op::Record {
                    kind,
                    device,
                    context,
                    requested,
                    accounted,
                    driver_ok: c.u8() % 4 != 0,
                }
            }
            12 => Op::ReleaseRecord { pick: c.u32() },
            13 => Op::Containing {
                pick: c.u32(),
                offset: u64::from(c.u32()),
            },
            14 => match c.u8() % 8 {
                0 => Op::DestroyContext { context: c.u8() },
                1 => Op::Trim,
                _ => Op::FailNextDeviceAllocation,
            },
            _ => Op::Free { pick: c.u32() },
        };
        ops.push(op);
    }
    (cfg, ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random byte strings through the same entry point as the fuzz target.
    #[test]
    fn run_ops_holds_on_random_bytes() {
        let mut x: u64 = 0x243F_6A88_85A3_08D3;
        let mut total = Summary::default();
        for case in 0..300 {
            let len = 64 + (case * 37) % 3000;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 24) as u8
                })
                .collect();
            let s = run_ops(&bytes).unwrap_or_else(|v| panic!("case {case}: {v}"));
            total.sub_allocations += s.sub_allocations;
            total.fallbacks += s.fallbacks;
            total.out_of_memory += s.out_of_memory;
            total.device_errors += s.device_errors;
            total.records += s.records;
            total.contexts_destroyed += s.contexts_destroyed;
        }
        // The random runs must actually reach every interesting path.
        assert!(total.sub_allocations > 1000, "{total:?}");
        assert!(total.fallbacks > 10, "{total:?}");
        assert!(total.out_of_memory > 10, "{total:?}");
        assert!(total.device_errors > 0, "{total:?}");
        assert!(total.records > 100, "{total:?}");
        assert!(total.contexts_destroyed > 10, "{total:?}");
    }

    #[test]
    fn a_broken_allocator_is_caught() {
        // The checks are not vacuous: a charge the model does not know about is found.
        let cfg = HarnessConfig::small();
        let alloc = Allocator::new(
            cfg.allocator,
            MockBackend::new(),
            InMemoryLedger::new(cfg.ledger_limits()),
        )
        .unwrap();
        let h = Harness {
            cfg,
            alloc,
            live: Vec::new(),
            next_handle: 1,
            summary: Summary::default(),
        };
        h.check().unwrap();
        h.alloc
            .ledger()
            .try_reserve(DeviceIndex(0), crate::UsageClass::Data, 4096)
            .unwrap();
        assert!(h.check().unwrap_err().contains("ledger 4096, model 0"));
        let p = h
            .alloc
            .backend()
            .allocate(DeviceIndex(1), ContextId(0), 10)
            .unwrap();
        assert!(h.check().is_err());
        h.alloc
            .backend()
            .free(DeviceIndex(1), ContextId(0), p)
            .unwrap();
    }
}
