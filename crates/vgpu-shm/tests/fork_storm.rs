//! 16 forked processes reserve and release at random against a small limit while an observer
//! process checks the invariant continuously; at the end usage is exactly 0.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
use vgpu_shm::{TableInit, UsageTable};

const WORKERS: usize = 16;
const OPS: usize = 3000;
const LIMIT: u64 = 1000;
const D0: DeviceIndex = DeviceIndex(0);

// Control words.
const STOP: usize = 0;
const VIOLATIONS: usize = 1;
const OBSERVATIONS: usize = 2;
const AUDITS: usize = 3;
const REFUSED: usize = 4;
const GRANTED: usize = 5;

fn init() -> TableInit {
    one_gpu("GPU-storm", LIMIT)
}

#[test]
fn sixteen_processes_never_exceed_the_limit_and_end_at_zero() {
    let path = table_file("storm", &init());
    let ctl = Control::new(8);

    let observer = fork_child(|| {
        let (t, me) = join(&path, &init());
        let mut n = 0u64;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while ctl.word(STOP).load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
            let used = t.usage(D0).used;
            if used > LIMIT {
                ctl.word(VIOLATIONS).fetch_add(1, Ordering::SeqCst);
            }
            n += 1;
            if n % 32 == 0 {
                // Under the device lock: total == Σ held == Σ HAMi used[].total <= limit.
                let audit = me.audit(D0).unwrap();
                if !audit.is_consistent() || audit.total > LIMIT {
                    eprintln!("audit violation: {audit:?}");
                    ctl.word(VIOLATIONS).fetch_add(1, Ordering::SeqCst);
                }
                ctl.word(AUDITS).fetch_add(1, Ordering::SeqCst);
            }
        }
        ctl.word(OBSERVATIONS).store(n, Ordering::SeqCst);
        0
    });

    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let ctl = &ctl;
            let path = &path;
            fork_child(move || {
                let (_t, me) = join(path, &init());
                let mut rng =
                    XorShift(0x1234_5678_9abc_def1 ^ (w as u64 + 1).wrapping_mul(0x9e37_79b9));
                let classes = [UsageClass::Context, UsageClass::Module, UsageClass::Data];
                let mut held: Vec<(UsageClass, u64)> = Vec::new();
                for _ in 0..OPS {
                    if !held.is_empty() && rng.next() % 2 == 0 {
                        let (c, b) = held.swap_remove((rng.next() % held.len() as u64) as usize);
                        me.release(D0, c, b);
                    } else {
                        let c = classes[(rng.next() % 3) as usize];
                        let b = 1 + rng.next() % 200;
                        match me.try_reserve(D0, c, b) {
                            Ok(()) => {
                                held.push((c, b));
                                ctl.word(GRANTED).fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => {
                                ctl.word(REFUSED).fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
                for (c, b) in held {
                    me.release(D0, c, b);
                }
                me.deregister().unwrap();
                0
            })
        })
        .collect();
    for pid in workers {
        assert_eq!(wait(pid), 0, "worker failed");
    }
    ctl.word(STOP).store(1, Ordering::SeqCst);
    assert_eq!(wait(observer), 0, "observer failed");

    let violations = load(ctl.word(VIOLATIONS));
    let observations = load(ctl.word(OBSERVATIONS));
    let audits = load(ctl.word(AUDITS));
    let (granted, refused) = (load(ctl.word(GRANTED)), load(ctl.word(REFUSED)));
    eprintln!("observations {observations}, audits {audits}, granted {granted}, refused {refused}");
    assert_eq!(violations, 0);
    assert!(
        observations > 0 && audits > 0,
        "the observer must have watched"
    );
    assert!(
        granted > 0 && refused > 0,
        "the limit must have been contended"
    );

    let t = UsageTable::open_existing(&path.0).unwrap();
    assert!(common::wait_until(Duration::from_secs(2), || t
        .snapshot()
        .processes
        .is_empty()));
    let snap = t.snapshot();
    assert_eq!(snap.devices[0].used, 0);
    assert_eq!(
        (
            snap.devices[0].context,
            snap.devices[0].module,
            snap.devices[0].data
        ),
        (0, 0, 0)
    );
    assert_eq!(snap.proc_num, 0);
}
