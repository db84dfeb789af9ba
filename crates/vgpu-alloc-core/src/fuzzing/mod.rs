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

use std::fmt;

use crate::allocator::Allocator;
use crate::backend::ContextId;
use crate::ledger::{DeviceIndex, InMemoryLedger};
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
    Record(RecordOp),
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

/// The fields of [`Op::Record`]: an allocation the hook makes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordOp {
    /// Index into the recordable kinds.
    pub kind: u8,
    /// Device (mod [`DEVICES`]).
    pub device: u8,
    /// Context (mod [`CONTEXTS`]).
    pub context: u8,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes to charge.
    pub accounted: u64,
    /// Whether the driver call succeeds.
    pub driver_ok: bool,
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

// Defined before the submodules: a `macro_rules!` is visible only below its definition.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

mod checks;
mod decode;
mod model;

pub use decode::{decode, edge_sizes};
use model::Harness;

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

fn dev(d: u8) -> DeviceIndex {
    DeviceIndex(u32::from(d) % DEVICES as u32)
}

fn ctx(c: u8) -> ContextId {
    ContextId(u64::from(c % CONTEXTS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DeviceBackend;
    use crate::ledger::UsageLedger;

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
