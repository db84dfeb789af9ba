//! The harness: an allocator under test, the model of what it should hold, and each
//! operation applied to both.

use super::{DEVICES, HarnessConfig, Op, RECORD_KINDS, RecordOp, Summary, ctx, dev};

use crate::allocator::{AllocError, Allocator, FreeError};
use crate::backend::{ContextId, DeviceBackend, DevicePtr};
use crate::ledger::{DeviceIndex, InMemoryLedger, UsageLedger};
use crate::mock::MockBackend;
use crate::table::AllocationKind;

#[derive(Debug, Clone, Copy)]
pub(super) struct Live {
    pub(super) kind: AllocationKind,
    pub(super) key: u64,
    pub(super) device: DeviceIndex,
    pub(super) context: ContextId,
    pub(super) requested: u64,
    /// Bytes charged to the ledger by this entry itself (0 for sub-allocations).
    pub(super) accounted: u64,
    /// Bytes occupied at `key` (chunks for sub-allocations).
    pub(super) span: u64,
}

type Alloc = Allocator<MockBackend, InMemoryLedger>;

pub(super) struct Harness {
    pub(super) cfg: HarnessConfig,
    pub(super) alloc: Alloc,
    pub(super) live: Vec<Live>,
    pub(super) next_handle: u64,
    pub(super) summary: Summary,
}

impl Harness {
    pub(super) fn limit(&self, d: DeviceIndex) -> Option<u64> {
        self.cfg.limits[d.as_usize()]
    }

    pub(super) fn used(&self, d: DeviceIndex) -> u64 {
        self.alloc.ledger().usage(d).used
    }

    pub(super) fn step(&mut self, op: &Op) -> Result<(), String> {
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
            Op::Record(r) => self.record(&r),
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

    pub(super) fn allocate(
        &mut self,
        d: DeviceIndex,
        c: ContextId,
        size: u64,
    ) -> Result<(), String> {
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
    pub(super) fn check_new_region(
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

    pub(super) fn pick(&self, pick: u32) -> Option<usize> {
        (!self.live.is_empty()).then(|| pick as usize % self.live.len())
    }

    pub(super) fn free(&mut self, pick: u32) -> Result<(), String> {
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

    pub(super) fn release_record(&mut self, pick: u32) -> Result<(), String> {
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

    pub(super) fn record(&mut self, op: &RecordOp) -> Result<(), String> {
        let kind = RECORD_KINDS[op.kind as usize % RECORD_KINDS.len()];
        let (d, c) = (dev(op.device), ctx(op.context));
        let (requested, accounted, driver_ok) = (op.requested, op.accounted, op.driver_ok);
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

    pub(super) fn containing(&mut self, pick: u32, offset: u64) -> Result<(), String> {
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

    pub(super) fn destroy_context(&mut self, c: ContextId) -> Result<(), String> {
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
}
