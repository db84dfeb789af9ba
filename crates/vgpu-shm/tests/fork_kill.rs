//! Children are SIGKILLed at random moments of reserve/release storms (inside locks, halfway
//! through updates, between the two steps of a host-to-device move); afterwards the table's
//! device and host-backed usage equal exactly what the survivors hold, and no survivor ever
//! waited long.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
use vgpu_shm::{HostPolicy, TableInit, UsageTable};

const FIRST: usize = 16;
const LATE: usize = 8;
const KILLS: usize = 12;
const LIMIT: u64 = 20_000;
const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);

// Control words: [STOP, RELEASE, then per child: READY, HELD0, HELD1, MAX_OP_MICROS, OPS,
// HOST0, HOST1].
const STOP: usize = 0;
const RELEASE: usize = 1;
const PER: usize = 7;
fn w(child: usize, field: usize) -> usize {
    2 + child * PER + field
}

fn init() -> TableInit {
    TableInit {
        uuids: vec!["GPU-k0".into(), "GPU-k1".into()],
        memory_limits: vec![Some(LIMIT), Some(LIMIT / 2)],
        sm_limits: vec![None, None],
        priority: 1,
    }
}

/// Device 0 oversubscribes (device + host within the limit plus a spill), device 1 spills only.
fn host_policies(t: &UsageTable) {
    let policy = |spill, oversubscribe| HostPolicy {
        spill,
        oversubscribe,
    };
    t.set_host_policy(D0, policy(LIMIT / 4, true)).unwrap();
    t.set_host_policy(D1, policy(LIMIT / 4, false)).unwrap();
}

/// One thing a child holds: device bytes of a class, or host-backed bytes (`None`).
type Held = (DeviceIndex, Option<UsageClass>, u64);

fn storm(path: &TempPath, ctl: &Control, child: usize) -> i32 {
    let (_t, me) = join(path, &init());
    let mut rng =
        XorShift(0xdead_beef_cafe_f00d ^ (child as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let classes = [UsageClass::Context, UsageClass::Module, UsageClass::Data];
    let mut held: Vec<Held> = Vec::new();
    let mut max_op = Duration::ZERO;
    let mut kinds = [Duration::ZERO; 3];
    let mut ops = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while ctl.word(STOP).load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
        let start = Instant::now();
        let kind;
        if !held.is_empty() && rng.next() % 2 == 0 {
            let i = (rng.next() % held.len() as u64) as usize;
            match held[i] {
                // A host-backed entry moves onto the device half of the time: device room
                // first, then the host bytes go (a kill in between holds both).
                (d, None, b) if rng.next() % 2 == 0 => {
                    if me.try_reserve_move(d, b).is_ok() {
                        me.release_host(d, b);
                        held[i] = (d, Some(UsageClass::Data), b);
                    }
                }
                _ => match held.swap_remove(i) {
                    (d, Some(c), b) => me.release(d, c, b),
                    (d, None, b) => me.release_host(d, b),
                },
            }
            kind = 0;
        } else {
            let d = if rng.next() % 3 == 0 { D1 } else { D0 };
            let b = 1 + rng.next() % 1500;
            let pick = rng.next() % 4;
            let ok = if pick == 3 {
                me.try_reserve_host(d, b).is_ok()
            } else {
                me.try_reserve(d, classes[pick as usize], b).is_ok()
            };
            if ok {
                held.push((d, (pick != 3).then(|| classes[pick as usize]), b));
                kind = 1;
            } else {
                kind = 2;
            }
        }
        let took = start.elapsed();
        kinds[kind] = kinds[kind].max(took);
        max_op = max_op.max(took);
        ops += 1;
    }
    if std::env::var_os("VGPU_SHM_TEST_VERBOSE").is_some() {
        eprintln!(
            "child {child}: slowest release {:?}, reserve {:?}, refusal {:?}",
            kinds[0], kinds[1], kinds[2]
        );
    }
    let sum = |dev: DeviceIndex, host: bool| {
        held.iter()
            .filter(|h| h.0 == dev && h.1.is_none() == host)
            .map(|h| h.2)
            .sum::<u64>()
    };
    ctl.word(w(child, 1))
        .store(sum(D0, false), Ordering::SeqCst);
    ctl.word(w(child, 2))
        .store(sum(D1, false), Ordering::SeqCst);
    ctl.word(w(child, 5)).store(sum(D0, true), Ordering::SeqCst);
    ctl.word(w(child, 6)).store(sum(D1, true), Ordering::SeqCst);
    ctl.word(w(child, 3))
        .store(max_op.as_micros() as u64, Ordering::SeqCst);
    ctl.word(w(child, 4)).store(ops, Ordering::SeqCst);
    ctl.word(w(child, 0)).store(1, Ordering::SeqCst);
    // Bounded, so a failing test never leaves an orphan behind.
    wait_until(Duration::from_secs(30), || {
        ctl.word(RELEASE).load(Ordering::SeqCst) != 0
    });
    for h in held {
        match h {
            (d, Some(c), b) => me.release(d, c, b),
            (d, None, b) => me.release_host(d, b),
        }
    }
    0
}

#[test]
fn killed_processes_give_back_exactly_their_usage() {
    let path = TempPath::new("kill");
    let ctl = Control::new(2 + (FIRST + LATE) * PER);
    host_policies(&UsageTable::open_or_create(&path.0, &init()).unwrap());
    let mut rng = XorShift(0x0bad_5eed_1234_4321);

    let mut children: Vec<(usize, libc::pid_t)> = (0..FIRST)
        .map(|c| (c, fork_child(|| storm(&path, &ctl, c))))
        .collect();
    let mut killed = Vec::new();
    let mut late = 0;
    std::thread::sleep(Duration::from_millis(100));
    for k in 0..KILLS {
        std::thread::sleep(Duration::from_micros(5_000 + rng.next() % 60_000));
        let victim = (rng.next() % children.len() as u64) as usize;
        let (c, pid) = children.swap_remove(victim);
        kill9(pid);
        killed.push((c, pid));
        if k % 2 == 1 && late < LATE {
            // Newcomers register while others die.
            let c = FIRST + late;
            late += 1;
            children.push((c, fork_child(|| storm(&path, &ctl, c))));
        }
    }
    for &(_, pid) in &killed {
        assert_eq!(wait(pid), 128 + libc::SIGKILL);
    }
    std::thread::sleep(Duration::from_millis(100));
    ctl.word(STOP).store(1, Ordering::SeqCst);
    let all_ready = wait_until(Duration::from_secs(10), || {
        children.iter().all(|&(c, _)| load(ctl.word(w(c, 0))) == 1)
    });
    if !all_ready {
        for &(c, pid) in &children {
            eprintln!("child {c} ready={}", load(ctl.word(w(c, 0))));
            kill9(pid);
            wait(pid);
        }
        panic!("a survivor hung or failed");
    }

    let expect0: u64 = children.iter().map(|&(c, _)| load(ctl.word(w(c, 1)))).sum();
    let expect1: u64 = children.iter().map(|&(c, _)| load(ctl.word(w(c, 2)))).sum();
    let host0: u64 = children.iter().map(|&(c, _)| load(ctl.word(w(c, 5)))).sum();
    let host1: u64 = children.iter().map(|&(c, _)| load(ctl.word(w(c, 6)))).sum();
    let max_op = children
        .iter()
        .map(|&(c, _)| load(ctl.word(w(c, 3))))
        .max()
        .unwrap();
    let ops: u64 = children.iter().map(|&(c, _)| load(ctl.word(w(c, 4)))).sum();
    eprintln!(
        "{} survivors, {} killed, {ops} survivor ops, slowest op {max_op} µs, survivors hold \
         {expect0} + {expect1} on the devices, {host0} + {host1} host-backed",
        children.len(),
        killed.len()
    );

    let t = UsageTable::open_existing(&path.0).unwrap(); // attaching sweeps
    t.sweep_dead().unwrap();
    let snap = t.snapshot();
    assert_eq!(
        snap.devices[0].used, expect0,
        "device 0 usage != what survivors hold"
    );
    assert_eq!(
        snap.devices[1].used, expect1,
        "device 1 usage != what survivors hold"
    );
    assert_eq!(
        (snap.devices[0].host, snap.devices[1].host),
        (host0, host1),
        "host-backed usage != what survivors hold"
    );
    // The bounds held: device 0's device and host bytes together within limit + spill,
    // device 1's host bytes within the spill.
    assert!(expect0 + host0 <= LIMIT + LIMIT / 4 && host1 <= LIMIT / 4);
    assert!(host0 + host1 > 0, "the storm never held host-backed memory");
    assert_eq!(snap.processes.len(), children.len());
    assert_eq!(snap.proc_num as usize, children.len());
    assert!(snap.processes.iter().all(|p| p.alive));
    let auditor = t.register_self().unwrap();
    for d in [D0, D1] {
        let audit = auditor.audit(d).unwrap();
        assert!(audit.is_consistent(), "{audit:?}");
    }
    drop(auditor);
    assert!(max_op < 1_000_000, "an operation waited {max_op} µs");

    ctl.word(RELEASE).store(1, Ordering::SeqCst);
    for &(_, pid) in &children {
        assert_eq!(wait(pid), 0);
    }
    let snap = t.snapshot();
    assert_eq!(
        (snap.devices[0].used, snap.devices[1].used, snap.proc_num),
        (0, 0, 0)
    );
    assert_eq!((snap.devices[0].host, snap.devices[1].host), (0, 0));
}
