//! proptest state-machine tests: the region bitmap, the allocation table and the whole
//! allocator against simple models.

use proptest::prelude::*;
use vgpu_alloc_core::fuzzing::{self, HarnessConfig, Op, RecordOp};
use vgpu_alloc_core::region::{Region, RegionError};
use vgpu_alloc_core::*;

// ---- Region bitmap vs a Vec<bool> ------------------------------------------------

#[derive(Debug, Clone)]
enum RegionOp {
    Allocate(u32),
    Free(usize),
    /// Free a run that was never handed out as such (must be refused, change nothing).
    BadFree(u32, u32),
}

fn region_op(chunks: u32) -> impl Strategy<Value = RegionOp> {
    prop_oneof![
        4 => (1..=chunks / 3).prop_map(RegionOp::Allocate),
        1 => (1u32..=3).prop_map(RegionOp::Allocate),
        3 => any::<usize>().prop_map(RegionOp::Free),
        1 => (0..chunks + 2, 0..chunks).prop_map(|(s, n)| RegionOp::BadFree(s, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn region_matches_a_bool_model(
        chunks in prop_oneof![Just(64u32), Just(130), 1u32..300],
        ops in prop::collection::vec(region_op(300), 1..200),
    ) {
        let mut r = Region::new(DevicePtr(1 << 40), 9, chunks);
        let mut used = vec![false; chunks as usize];
        let mut live: Vec<(u32, u32)> = Vec::new();
        for op in ops {
            match op {
                RegionOp::Allocate(n) => {
                    let n = n.min(chunks);
                    let fits = used.windows(n as usize).any(|w| w.iter().all(|u| !u));
                    match r.allocate(n) {
                        Some(s) => {
                            let run = &mut used[s as usize..(s + n) as usize];
                            prop_assert!(run.iter().all(|u| !u), "handed out a used chunk");
                            run.fill(true);
                            live.push((s, n));
                            prop_assert_eq!(r.address_of(s).0 % 512, 0);
                        }
                        // Next fit may only fail when no run of n free chunks exists at all.
                        None => prop_assert!(!fits, "refused {} chunks although a run exists", n),
                    }
                }
                RegionOp::Free(i) if !live.is_empty() => {
                    let (s, n) = live.swap_remove(i % live.len());
                    r.free(s, n).unwrap();
                    used[s as usize..(s + n) as usize].fill(false);
                }
                RegionOp::Free(_) => {}
                RegionOp::BadFree(s, n) => {
                    // Anything but exactly a live run is refused and changes nothing,
                    // including a part of a run or two adjacent runs.
                    if !live.contains(&(s, n)) {
                        let before = r.free_chunks();
                        let refused = matches!(
                            r.free(s, n),
                            Err(RegionError::OutOfRange { .. } | RegionError::NotAllocated { .. })
                        );
                        prop_assert!(refused);
                        prop_assert_eq!(r.free_chunks(), before);
                    }
                }
            }
            let free = used.iter().filter(|u| !**u).count() as u32;
            prop_assert_eq!(r.free_chunks(), free);
            // Every chunk of a live run leads back to the run's start.
            for &(s, n) in &live {
                for k in [s, s + n / 2, s + n - 1] {
                    prop_assert_eq!(r.run_start_at_or_before(k, n), Some(s));
                }
            }
            prop_assert_eq!(r.is_empty(), free == chunks);
        }
        for (s, n) in live {
            r.free(s, n).unwrap();
        }
        prop_assert!(r.is_empty());
        prop_assert_eq!(r.allocate(chunks), Some(0), "a fully freed region serves a full-size run");
    }
}

// ---- Allocation table vs a naive list ----------------------------------------------

#[derive(Debug, Clone)]
enum TableOp {
    Insert {
        kind: u8,
        key: u64,
        size: u64,
        ctx: u64,
    },
    Remove {
        kind: u8,
        key: u64,
    },
    Containing(u64),
    Drain(u64),
}

const KINDS: [AllocationKind; 4] = [
    AllocationKind::Direct,
    AllocationKind::Managed,
    AllocationKind::Array,
    AllocationKind::VmmHandle,
];

fn table_op() -> impl Strategy<Value = TableOp> {
    // Keys on a coarse grid of 4 KiB slots so inserts, removes and lookups collide.
    let key = (0u64..64).prop_map(|k| k << 12);
    prop_oneof![
        4 => (0u8..4, key.clone(), 1u64..3 << 12, 0u64..3)
            .prop_map(|(kind, key, size, ctx)| TableOp::Insert { kind, key, size, ctx }),
        2 => (0u8..4, key).prop_map(|(kind, key)| TableOp::Remove { kind, key }),
        3 => (0u64..70 << 12).prop_map(TableOp::Containing),
        1 => (0u64..3).prop_map(TableOp::Drain),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn table_matches_a_list_model(ops in prop::collection::vec(table_op(), 1..150)) {
        let mut t = AllocationTable::new();
        let mut model: Vec<Allocation> = Vec::new();
        for op in ops {
            match op {
                TableOp::Insert { kind, key, size, ctx } => {
                    let kind = KINDS[kind as usize];
                    let a = Allocation {
                        kind, key, device: DeviceIndex(0), context: ContextId(ctx),
                        requested: size, accounted: size, placement: Placement::Own,
                    };
                    // Address kinds share one namespace; handle kinds one per kind.
                    let clash = model.iter().any(|m| {
                        m.key == key && (m.kind == kind || (m.kind.is_address() && kind.is_address()))
                    });
                    // The model keeps live address ranges disjoint, as the driver does.
                    let overlaps = kind.is_address() && model.iter().any(|m| {
                        m.kind.is_address() && m.key < key + size && key < m.key + m.requested
                    });
                    if overlaps && !clash {
                        continue;
                    }
                    prop_assert_eq!(t.insert(a).is_ok(), !clash);
                    if !clash {
                        model.push(a);
                    }
                }
                TableOp::Remove { kind, key } => {
                    let kind = KINDS[kind as usize];
                    let pos = model.iter().position(|m| m.kind == kind && m.key == key);
                    let got = t.remove(kind, key);
                    prop_assert_eq!(got, pos.map(|p| model.swap_remove(p)));
                }
                TableOp::Containing(addr) => {
                    let want = model.iter().find(|m| {
                        m.kind.is_address() && m.key <= addr && addr < m.key + m.requested
                    });
                    prop_assert_eq!(t.containing(DevicePtr(addr)).map(|(_, a)| *a), want.copied());
                }
                TableOp::Drain(ctx) => {
                    let mut got = t.drain_context(ContextId(ctx));
                    let mut want: Vec<Allocation> =
                        model.iter().filter(|m| m.context.0 == ctx).copied().collect();
                    model.retain(|m| m.context.0 != ctx);
                    got.sort_by_key(|a| (a.key, a.kind));
                    want.sort_by_key(|a| (a.key, a.kind));
                    prop_assert_eq!(got, want);
                }
            }
            prop_assert_eq!(t.len(), model.len());
        }
    }
}

// ---- The whole allocator through the checking harness ------------------------------

fn size_strategy(cfg: HarnessConfig) -> BoxedStrategy<u64> {
    let edges = fuzzing::edge_sizes(&cfg);
    let t = cfg.allocator.suballoc_threshold;
    prop_oneof![
        2 => prop::sample::select(edges),
        5 => 1..t,
        2 => 1..t / 8,
        1 => t..2 * cfg.allocator.region_size,
    ]
    .boxed()
}

fn op_strategy(cfg: HarnessConfig) -> impl Strategy<Value = Op> {
    let size = size_strategy(cfg);
    prop_oneof![
        5 => (0u8..4, 0u8..3, size.clone()).prop_map(|(device, context, size)| Op::Allocate { device, context, size }),
        4 => size.clone().prop_map(|size| Op::Allocate { device: 0, context: 0, size }),
        5 => any::<u32>().prop_map(|pick| Op::Free { pick }),
        1 => any::<u64>().prop_map(|addr| Op::FreeUnknown { addr }),
        2 => (any::<u8>(), 0u8..4, 0u8..3, size.clone(), 0..cfg.allocator.region_size, any::<bool>())
            .prop_map(move |(kind, device, context, requested, accounted, driver_ok)| Op::Record(RecordOp {
                kind, device, context, requested: requested % (4 * cfg.allocator.region_size),
                accounted, driver_ok,
            })),
        1 => any::<u32>().prop_map(|pick| Op::ReleaseRecord { pick }),
        2 => (any::<u32>(), any::<u64>()).prop_map(|(pick, offset)| Op::Containing { pick, offset }),
        1 => (0u8..3).prop_map(|context| Op::DestroyContext { context }),
        1 => Just(Op::FailNextDeviceAllocation),
        1 => Just(Op::Trim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn allocator_matches_the_model_small_sizes(
        suballoc in prop::bool::weighted(0.85),
        ops in prop::collection::vec(op_strategy(HarnessConfig::small()), 1..300),
    ) {
        let mut cfg = HarnessConfig::small();
        cfg.allocator.suballoc = suballoc;
        if let Err(v) = fuzzing::run(&cfg, &ops) {
            return Err(TestCaseError::fail(v.to_string()));
        }
    }

    #[test]
    fn allocator_matches_the_model_default_sizes(
        ops in prop::collection::vec(op_strategy(HarnessConfig::default_sizes()), 1..200),
    ) {
        if let Err(v) = fuzzing::run(&HarnessConfig::default_sizes(), &ops) {
            return Err(TestCaseError::fail(v.to_string()));
        }
    }
}

#[test]
fn the_fallback_rule_holds_at_the_exact_boundary() {
    // Two full regions' worth of limit; a direct allocation takes most of it, so the
    // regions that follow are cut to what remains: no small request falls back to a
    // direct allocation, and the limit is used to the last byte.
    let cfg = HarnessConfig::small();
    let a = cfg.allocator;
    let mut limits = [None; MAX_DEVICES];
    limits[0] = Some(2 * a.region_size);
    let alloc = Allocator::new(a, MockBackend::new(), InMemoryLedger::new(limits)).unwrap();
    let d = DeviceIndex(0);
    let first = alloc
        .allocate(d, ContextId(0), a.suballoc_threshold - 1)
        .unwrap();
    assert_eq!(first.kind, AllocationKind::SubAllocated);
    // Use up the rest of a region's worth directly, except two pages.
    let direct = alloc
        .allocate(d, ContextId(0), a.region_size - 2 * a.align)
        .unwrap();
    assert_eq!(direct.kind, AllocationKind::Direct);
    // Fill: regions of 16, 32 and then (64 wanted) the 16 KiB that remain.
    let mut subs = vec![first.ptr];
    while let Ok(r) = alloc.allocate(d, ContextId(0), a.suballoc_threshold - 1) {
        assert_eq!(r.kind, AllocationKind::SubAllocated, "never direct");
        subs.push(r.ptr);
    }
    let sizes: Vec<u64> = alloc
        .regions()
        .iter()
        .map(|r| u64::from(r.chunks) * a.chunk_size)
        .collect();
    assert_eq!(sizes, [8 << 10, 16 << 10, 32 << 10, 16 << 10]);
    assert_eq!(
        subs.len(),
        1 + 2 + 4 + 2,
        "requests of 16 chunks filled every region"
    );
    assert_eq!(alloc.usage(d).used, 2 * a.region_size);
    // Now nothing fits, sub or direct: the refusal is the same one a direct would get.
    match alloc.allocate(d, ContextId(0), 1) {
        Err(AllocError::OutOfMemory(oom)) => assert_eq!(oom.in_use, 2 * a.region_size),
        other => panic!("{other:?}"),
    }
    // But a request that fits in a chunk still left in the region is served there.
    alloc.free(subs[1]).unwrap();
    let again = alloc.allocate(d, ContextId(0), 1).unwrap();
    assert_eq!(again.kind, AllocationKind::SubAllocated);
}

// ---- Filling the limit with any mix of sizes (Issue 12, defect 10) -------------------

#[derive(Debug, Clone)]
enum MixOp {
    Allocate { context: u64, size: u64 },
    Free(usize),
}

fn mix_op() -> impl Strategy<Value = MixOp> {
    const MIB: u64 = 1 << 20;
    let size = prop_oneof![
        4 => 1u64..64 << 10,
        2 => 1u64..2 * MIB,
        1 => 2 * MIB..40 * MIB,
    ];
    prop_oneof![
        6 => (0u64..3, size).prop_map(|(context, size)| MixOp::Allocate { context, size }),
        2 => any::<usize>().prop_map(MixOp::Free),
    ]
}

/// What a live allocation may cost the program: its chunks below the sub-allocation
/// threshold, its 2 MiB pages above it.
fn entitled(a: &Allocation, cfg: &AllocatorConfig) -> u64 {
    if a.requested < cfg.suballoc_threshold {
        a.requested.next_multiple_of(cfg.chunk_size)
    } else {
        a.accounted
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// After any history of allocations and frees in several contexts, requests of one
    /// chunk in every context are served until the limit is within one 2 MiB page of
    /// full, counting what the program asked for (not the regions' free space); and at
    /// every step the charge is exactly what the device holds for the allocator.
    #[test]
    fn any_mix_of_sizes_fills_the_limit_to_within_one_page(
        pages in 1u64..200,
        ops in prop::collection::vec(mix_op(), 0..80),
    ) {
        const PAGE: u64 = 2 << 20;
        let cfg = AllocatorConfig::default();
        let limit = pages * PAGE;
        let mut limits = [None; MAX_DEVICES];
        limits[0] = Some(limit);
        let alloc = Allocator::new(cfg, MockBackend::new(), InMemoryLedger::new(limits)).unwrap();
        let d = DeviceIndex(0);
        let mut live: Vec<DevicePtr> = Vec::new();
        let charge_is_held = |alloc: &Allocator<MockBackend, InMemoryLedger>| {
            let regions: u64 = alloc.regions().iter().map(|r| u64::from(r.chunks) * cfg.chunk_size).sum();
            let snap = alloc.snapshot();
            let direct = snap.iter().filter(|a| a.kind == AllocationKind::Direct);
            let charged: u64 = direct.clone().map(|a| a.accounted).sum();
            let raw: u64 = direct.map(|a| a.requested).sum();
            (alloc.usage(d).used == regions + charged, alloc.backend().used(d) == regions + raw)
        };
        for op in ops {
            match op {
                MixOp::Allocate { context, size } => {
                    if let Ok(r) = alloc.allocate(d, ContextId(context), size) {
                        live.push(r.ptr);
                    }
                }
                MixOp::Free(i) if !live.is_empty() => {
                    let p = live.swap_remove(i % live.len());
                    alloc.free(p).unwrap();
                }
                MixOp::Free(_) => {}
            }
            prop_assert_eq!(charge_is_held(&alloc), (true, true));
        }
        // Fill: one chunk at a time, round robin, until every context is refused.
        let mut refused = [false; 3];
        while !refused.iter().all(|&r| r) {
            for c in 0..3u64 {
                match alloc.allocate(d, ContextId(c), cfg.chunk_size) {
                    Ok(_) => refused[c as usize] = false,
                    Err(AllocError::OutOfMemory(_)) => refused[c as usize] = true,
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
        }
        prop_assert_eq!(charge_is_held(&alloc), (true, true));
        let used: u64 = alloc.snapshot().iter().map(|a| entitled(a, &cfg)).sum();
        prop_assert!(
            used + PAGE > limit,
            "the program holds {} of a {} limit when refused", used, limit
        );
    }
}
