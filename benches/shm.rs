//! Reserve + release through the shared table with 1, 64 and 1,024 attached process slots:
//! the cost must not grow with the number of processes (HAMi-core sums every slot per check).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
use vgpu_shm::{TableInit, UsageTable};

fn reserve_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("shm_reserve_release");
    for slots in [1usize, 64, 1024] {
        let path = std::env::temp_dir().join(format!(
            "vgpu-bench-shm-{}-{slots}.cache",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let init = TableInit {
            uuids: vec!["GPU-bench".into()],
            memory_limits: vec![Some(1 << 40)],
            sm_limits: vec![None],
            priority: 1,
        };
        let table = UsageTable::open_or_create(&path, &init).expect("create table");
        let registered: Vec<_> = (0..slots)
            .map(|_| table.register_self().expect("register"))
            .collect();
        // Every slot holds something, as in a busy container.
        for s in &registered {
            s.try_reserve(DeviceIndex(0), UsageClass::Data, 1 << 20)
                .expect("reserve");
        }
        let me = &registered[slots / 2];
        group.bench_with_input(BenchmarkId::from_parameter(slots), &slots, |b, _| {
            b.iter(|| {
                me.try_reserve(DeviceIndex(0), UsageClass::Data, std::hint::black_box(4096))
                    .expect("fits");
                me.release(DeviceIndex(0), UsageClass::Data, 4096);
            })
        });
        // Leave without 1,024 deregistrations (each sweeps); the file goes away anyway.
        std::mem::forget(registered);
        let _ = std::fs::remove_file(&path);
    }
    group.finish();
}

criterion_group!(benches, reserve_release);
criterion_main!(benches);
