//! A forked child must not keep its parent's slot alive, and must not use the parent's handle.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
use vgpu_shm::{ShmError, TableInit, UsageTable};

const D0: DeviceIndex = DeviceIndex(0);

fn init() -> TableInit {
    one_gpu("GPU-fork", 1000)
}

#[test]
fn forked_child_neither_keeps_nor_uses_the_parents_slot() {
    let path = table_file("forkchild", &init());
    // [0]: grandchild pid, [1]: grandchild verdict (1 ok), [2]: release grandchild.
    let ctl = Control::new(4);

    let parent = fork_child(|| {
        let (t, me) = join(&path, &init());
        me.try_reserve(D0, UsageClass::Data, 600).unwrap();
        let grandchild = fork_child(|| {
            // The inherited handle refuses to act for the parent.
            let refused = me.try_reserve(D0, UsageClass::Data, 1).is_err();
            let forked = matches!(t.register_self(), Err(ShmError::Forked));
            // A fresh handle works.
            let (_fresh, mine) = join(&path, &init());
            let ok = refused && forked && mine.try_reserve(D0, UsageClass::Data, 100).is_ok();
            ctl.word(1).store(if ok { 1 } else { 2 }, Ordering::SeqCst);
            // Bounded, so a failing test never leaves an orphan behind.
            wait_until(Duration::from_secs(20), || {
                ctl.word(2).load(Ordering::SeqCst) != 0
            });
            0
        });
        ctl.word(0).store(grandchild as u64, Ordering::SeqCst);
        assert!(wait_until(Duration::from_secs(10), || load(ctl.word(1)) != 0));
        std::mem::forget(me); // die without deregistering
        0
    });
    assert_eq!(wait(parent), 0);
    assert_eq!(load(ctl.word(1)), 1, "grandchild checks failed");

    // The parent is dead, its child lives: the parent's 600 bytes come back.
    let t = UsageTable::open_existing(&path.0).unwrap();
    t.sweep_dead().unwrap();
    let snap = t.snapshot();
    assert_eq!(snap.devices[0].used, 100);
    assert_eq!(snap.processes.len(), 1);
    ctl.word(2).store(1, Ordering::SeqCst);
    let grandchild = load(ctl.word(0)) as libc::pid_t;
    // Not our child (the parent was): poll until it is gone.
    assert!(wait_until(Duration::from_secs(10), || {
        // SAFETY: signal 0 only checks existence.
        let rc = unsafe { libc::kill(grandchild, 0) };
        rc != 0
    }));
    assert!(wait_until(Duration::from_secs(2), || t.snapshot().devices
        [0]
    .used
        == 0));
}
