//! vgpu-alloc-core hot paths: what the hook pays per cuMemAlloc/cuMemFree on top of the
//! driver. Run: `cargo bench -p vgpu-benches --bench alloc_core -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use vgpu_alloc_core::{
    Allocator, ContextId, DeviceIndex, DevicePtr, InMemoryLedger, MockBackend, UsageClass,
};

const MIB: u64 = 1 << 20;
const D0: DeviceIndex = DeviceIndex(0);
const C1: ContextId = ContextId(1);

fn allocator() -> Allocator<MockBackend, InMemoryLedger> {
    Allocator::over_mock(Some(1 << 40))
}

/// cuMemAlloc(1 KiB) + cuMemFree, served from a region (no device call).
fn suballoc_pair(c: &mut Criterion) {
    let a = allocator();
    // Keep one allocation live so the region stays and the pair measures the steady state.
    let _keep = a.allocate(D0, C1, 1024).unwrap();
    c.bench_function("suballoc_free_pair/1KiB", |b| {
        b.iter(|| {
            let r = a.allocate(D0, C1, black_box(1024)).unwrap();
            a.free(r.ptr).unwrap();
        })
    });
    c.bench_function("suballoc_free_pair/2MiB-1", |b| {
        b.iter(|| {
            let r = a.allocate(D0, C1, black_box(2 * MIB - 1)).unwrap();
            a.free(r.ptr).unwrap();
        })
    });
}

/// The GPU bench's `bench_small`: 20,000 cuMemAlloc(1 KiB) into a fresh allocator (one
/// region, created by the first call), then 20,000 frees in allocation order. Includes
/// what a burst pays beyond a steady-state pair: the table and region bookkeeping growing.
fn small_burst(c: &mut Criterion) {
    const N: usize = 20_000;
    let mut group = c.benchmark_group("small_burst_20000x1KiB");
    group.throughput(criterion::Throughput::Elements(N as u64));
    group.bench_function("allocate", |b| {
        b.iter_batched(
            || (allocator(), Vec::with_capacity(N)),
            |(a, mut v)| {
                for _ in 0..N {
                    v.push(a.allocate(D0, C1, black_box(1024)).unwrap().ptr);
                }
                (a, v)
            },
            BatchSize::PerIteration,
        )
    });
    group.bench_function("free", |b| {
        b.iter_batched(
            || {
                let a = allocator();
                let v: Vec<DevicePtr> = (0..N)
                    .map(|_| a.allocate(D0, C1, 1024).unwrap().ptr)
                    .collect();
                (a, v)
            },
            |(a, v)| {
                for p in &v {
                    a.free(*p).unwrap();
                }
                a
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// The ledger step of a direct allocation: reserve 2 MiB against the limit, release it.
fn direct_reserve_release(c: &mut Criterion) {
    let a = allocator();
    c.bench_function("direct_reserve_release/2MiB", |b| {
        b.iter(|| {
            let r = a.reserve(D0, UsageClass::Data, black_box(2 * MIB)).unwrap();
            drop(r);
        })
    });
    // The whole direct path including the mock device (its own lock and map).
    c.bench_function("direct_allocate_free_mock_device/4MiB", |b| {
        b.iter(|| {
            let r = a.allocate(D0, C1, black_box(4 * MIB)).unwrap();
            a.free(r.ptr).unwrap();
        })
    });
}

/// cuMemFree of a random live allocation with N allocations live (HAMi-core walks a
/// list here). Each iteration's setup allocates a replacement and picks a victim at
/// random, so the live count stays N and only the free is timed.
fn free_with_live(c: &mut Criterion) {
    let mut group = c.benchmark_group("free_with_live");
    for &(label, size) in &[("sub_1KiB", 1024u64), ("direct_2MiB", 2 * MIB)] {
        for &n in &[1usize, 10_000, 100_000] {
            let a = allocator();
            let mut live: Vec<DevicePtr> = (0..n)
                .map(|_| a.allocate(D0, C1, size).unwrap().ptr)
                .collect();
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
            group.bench_with_input(BenchmarkId::new(label, n), &n, |b, _| {
                b.iter_batched(
                    || {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let i = (x % live.len() as u64) as usize;
                        std::mem::replace(&mut live[i], a.allocate(D0, C1, size).unwrap().ptr)
                    },
                    |victim| a.free(victim).unwrap(),
                    BatchSize::SmallInput,
                )
            });
            assert_eq!(a.stats().live_allocations, n);
        }
    }
    group.finish();
}

/// cuMemFree newest-first with N allocations live: the pattern HAMi-core was measured
/// with (72 µs per free at 20,000 live on an H200, 29x the bare driver).
fn free_newest_first(c: &mut Criterion) {
    let mut group = c.benchmark_group("free_newest_first");
    for &n in &[1usize, 10_000, 100_000] {
        let a = allocator();
        let live: Vec<DevicePtr> = (0..n)
            .map(|_| a.allocate(D0, C1, 1024).unwrap().ptr)
            .collect();
        group.bench_with_input(BenchmarkId::new("sub_1KiB", n), &n, |b, _| {
            b.iter_batched(
                || a.allocate(D0, C1, 1024).unwrap().ptr,
                |p| a.free(p).unwrap(),
                BatchSize::SmallInput,
            )
        });
        assert_eq!(a.stats().live_allocations, live.len());
    }
    group.finish();
}

/// Which live allocation holds an address (`cuMemGetAddressRange`), 100,000 live.
fn containing(c: &mut Criterion) {
    let a = allocator();
    let subs: Vec<DevicePtr> = (0..100_000)
        .map(|_| a.allocate(D0, C1, 1000).unwrap().ptr)
        .collect();
    let mut i = 0usize;
    c.bench_function("containing/sub_interior/100000_live", |b| {
        b.iter(|| {
            i = (i + 7919) % subs.len();
            a.containing(DevicePtr(subs[i].0 + 999)).unwrap()
        })
    });
}

/// The machine's cost of one dependent random load in working sets of 32 KiB, 4 MiB and
/// 64 MiB: the yardstick for the large-N numbers above, which are a few such loads.
fn machine_random_load(c: &mut Criterion) {
    let mut group = c.benchmark_group("machine_random_load");
    for &(label, bytes) in &[
        ("32KiB", 32usize << 10),
        ("4MiB", 4 << 20),
        ("64MiB", 64 << 20),
    ] {
        let n = bytes / 8;
        // One random cycle through all slots, so every load depends on the previous one.
        let mut order: Vec<usize> = (0..n).collect();
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for i in (1..n).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let mut next = vec![0usize; n];
        for i in 0..n {
            next[order[i]] = order[(i + 1) % n];
        }
        let mut p = 0usize;
        group.bench_function(label, |b| {
            b.iter(|| {
                p = next[p];
                p
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    suballoc_pair,
    small_burst,
    direct_reserve_release,
    free_with_live,
    free_newest_first,
    containing,
    machine_random_load
);
criterion_main!(benches);
