//! Unit tests of the table against real files.

use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use vgpu_alloc_core::{DeviceIndex, OutOfMemory, UsageClass, UsageLedger};

use crate::layout::{self, FILE_LEN, HAMI_FILE_LEN, MAX_SLOTS, offsets};
use crate::{ImageError, ProcessSlot, ShmError, TableInit, UsageTable, validate_image};

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);

/// A unique path in the temp dir, removed on drop.
pub(crate) struct TempPath(pub PathBuf);

impl TempPath {
    /// Nothing is there: a file a killed run of the same pid left is removed first, so that no
    /// test joins it.
    pub(crate) fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("vgpu-shm-{tag}-{}-{n}.cache", std::process::id()));
        let _ = std::fs::remove_file(&p);
        Self(p)
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A fresh table at a temporary path named after `tag`, with [`init`]'s devices; the path
/// is removed when the returned guard drops.
fn table(tag: &str, limit0: u64, limit1: u64) -> (TempPath, UsageTable) {
    let p = TempPath::new(tag);
    let t = UsageTable::open_or_create(&p.0, &init(limit0, limit1)).unwrap();
    (p, t)
}

/// Asserts that `slot`'s audit of `device` finds `bytes` in the device total, the sum of
/// the slots' held bytes and HAMi's view alike.
#[track_caller]
fn assert_audit(slot: &ProcessSlot, device: DeviceIndex, bytes: u64) {
    assert_eq!(
        slot.audit(device).map(|a| (a.total, a.held, a.hami_used)),
        Some((bytes, bytes, bytes))
    );
}

/// `N` processes registered in `t` (this process, registered `N` times: one per slot).
fn registered<const N: usize>(t: &UsageTable) -> [ProcessSlot; N] {
    std::array::from_fn(|_| t.register_self().unwrap())
}

/// A table limited to 100 bytes per device with two registered processes, the first of
/// which holds `bytes` of data on device 0 (the victim of the dead-process cases).
fn first_of_two_holding(tag: &str, bytes: u64) -> (TempPath, UsageTable, [ProcessSlot; 2]) {
    let (p, t) = table(tag, 100, 100);
    let slots: [ProcessSlot; 2] = registered(&t);
    slots[0].try_reserve(D0, UsageClass::Data, bytes).unwrap();
    (p, t, slots)
}

fn init(limit0: u64, limit1: u64) -> TableInit {
    TableInit {
        uuids: vec!["GPU-aaaa".into(), "GPU-bbbb".into()],
        memory_limits: vec![Some(limit0), Some(limit1)],
        sm_limits: vec![Some(30), None],
        priority: 1,
    }
}

fn read_u64(bytes: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(bytes[off..off + 8].try_into().unwrap())
}
fn read_i32(bytes: &[u8], off: usize) -> i32 {
    i32::from_le_bytes(bytes[off..off + 4].try_into().unwrap())
}

/// The monitor's view: write raw bytes into the live file.
fn poke(path: &TempPath, off: usize, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path.0)
        .unwrap();
    f.write_all_at(bytes, off as u64).unwrap();
}

/// Cuts the file at `path` to `len` bytes (what an older library wrote, or a torn file).
fn cut_to(path: &TempPath, len: usize) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path.0)
        .unwrap()
        .set_len(len as u64)
        .unwrap();
}

/// Asserts that the image at `path` is refused as cut short, not read past its end.
#[track_caller]
fn assert_cut_short(path: &TempPath) {
    let b = std::fs::read(&path.0).unwrap();
    assert!(matches!(
        validate_image(&b),
        Err(ImageError::Truncated { .. })
    ));
}

/// The first writable open of an older file: asserts that it grew the file in place to the
/// current length and to extension minor version `minor`; the table and the file's bytes.
#[track_caller]
fn upgraded(path: &TempPath, minor: u32) -> (UsageTable, Vec<u8>) {
    let t = UsageTable::open_existing(&path.0).unwrap();
    assert_eq!(std::fs::metadata(&path.0).unwrap().len(), FILE_LEN as u64);
    let b = std::fs::read(&path.0).unwrap();
    assert_eq!(validate_image(&b).unwrap().minor_version, minor);
    (t, b)
}

#[test]
fn file_has_hami_layout_at_exact_offsets() {
    let (p, t) = table("layout", 1000, 2000);
    assert!(t.created());
    let me = t.register_self().unwrap();
    me.try_reserve(D1, UsageClass::Data, 300).unwrap();
    me.try_reserve(D1, UsageClass::Context, 20).unwrap();
    me.set_sm_util(D1, 42);
    t.touch_kernel_time();
    let b = std::fs::read(&p.0).unwrap();
    assert_eq!(b.len(), FILE_LEN);
    assert_eq!(read_i32(&b, 0), 19_920_718);
    assert_eq!(read_i32(&b, 4), 1);
    assert_eq!(read_i32(&b, 8), 2);
    assert_eq!(read_u64(&b, 16), u64::from(std::process::id()));
    assert_eq!(read_u64(&b, 56), 2);
    assert_eq!(&b[64..72], b"GPU-aaaa");
    assert_eq!(b[72], 0);
    assert_eq!(&b[64 + 96..64 + 96 + 8], b"GPU-bbbb");
    assert_eq!(read_u64(&b, 1600), 1000);
    assert_eq!(read_u64(&b, 1608), 2000);
    assert_eq!(read_u64(&b, 1728), 30);
    assert_eq!(read_u64(&b, 1736), 0);
    let slot0 = 1856;
    assert_eq!(read_i32(&b, slot0), std::process::id() as i32);
    let used1 = slot0 + 8 + 64; // used[1]
    assert_eq!(read_u64(&b, used1), 20); // context_size
    assert_eq!(read_u64(&b, used1 + 16), 300); // data_size
    assert_eq!(read_u64(&b, used1 + 32), 320); // total
    assert_eq!(read_u64(&b, slot0 + 1160 + 48 + 16), 42); // device_util[1].sm_util
    assert_eq!(read_i32(&b, slot0 + 1928), 1); // status
    assert_eq!(read_u64(&b, slot0 + 1936) % 2, 0); // seqlock even
    assert_eq!(read_i32(&b, 2_008_896), 1); // proc_num
    assert_eq!(read_i32(&b, 2_008_908), 1); // priority
    assert!(read_u64(&b, 2_008_912) > 1_700_000_000); // last_kernel_time
    assert_eq!(t.last_kernel_time(), read_u64(&b, 2_008_912));
    me.release(D1, UsageClass::Data, 300);
    me.release(D1, UsageClass::Context, 20);
}

#[test]
fn created_file_is_mode_0666() {
    let p = TempPath::new("mode");
    let _t = UsageTable::open_or_create(&p.0, &init(1, 1)).unwrap();
    let mode = std::fs::metadata(&p.0).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666);
}

#[test]
fn limits_in_an_existing_file_win_over_init() {
    let p = TempPath::new("win");
    let a = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    let b = UsageTable::open_or_create(&p.0, &init(5, 5)).unwrap();
    assert!(!b.created());
    assert_eq!(b.memory_limit(D0), Some(1000));
    assert_eq!(b.sm_limit(D0), Some(30));
    assert_eq!(b.uuid(D1), "GPU-bbbb");
    drop(a);
}

#[test]
fn refused_reservation_changes_nothing() {
    let (p, t) = table("refuse", 100, 100);
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 60).unwrap();
    let before = std::fs::read(&p.0).unwrap();
    let err = me.try_reserve(D0, UsageClass::Data, 41).unwrap_err();
    assert_eq!(
        err,
        OutOfMemory {
            device: D0,
            requested: 41,
            in_use: 60,
            limit: 100
        }
    );
    assert_eq!(std::fs::read(&p.0).unwrap(), before);
    assert_eq!(me.usage(D0).used, 60);
    me.release(D0, UsageClass::Data, 60);
    assert_eq!(t.usage(D0).used, 0);
    // Out-of-range device: refused, not a panic.
    assert!(
        me.try_reserve(DeviceIndex(99), UsageClass::Data, 1)
            .is_err()
    );
}

#[test]
fn dead_process_usage_returns_when_a_reservation_would_fail() {
    let (_p, t, [victim, other]) = first_of_two_holding("dead", 80);
    other.try_reserve(D0, UsageClass::Data, 10).unwrap();
    victim.simulate_death();
    assert_eq!(t.usage(D0).used, 90); // still counted until someone needs it
    other.try_reserve(D0, UsageClass::Data, 50).unwrap();
    assert_eq!(t.usage(D0).used, 60);
    let snap = t.snapshot();
    assert_eq!(snap.processes.len(), 1);
    assert_eq!(snap.proc_num, 1);
    assert_eq!(snap.processes[0].devices[0].data, 60);
    assert_audit(&other, D0, 60);
}

#[test]
fn periodic_sm_util_report_sweeps_dead_processes() {
    let (_p, t, [victim, other]) = first_of_two_holding("periodic", 40);
    victim.simulate_death();
    other.set_sm_util(D0, 5);
    // Nobody reserved or inspected; the SM-limit thread's next report (a second later) sweeps.
    let deadline = Instant::now() + std::time::Duration::from_secs(3);
    while t.usage(D0).used != 0 && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        other.set_sm_util(D0, 5);
    }
    assert_eq!(t.usage(D0).used, 0);
}

#[test]
fn reused_pid_does_not_keep_a_dead_slot_alive() {
    // The dead slot carries a pid (ours) that is alive and even has the right start time:
    // only the kernel-held liveness lock counts.
    let (_p, t) = table("pidreuse", 100, 100);
    let victim = t.register_self().unwrap();
    victim.try_reserve(D0, UsageClass::Data, 70).unwrap();
    victim.simulate_death();
    assert_eq!(t.sweep_dead().unwrap(), 1);
    assert_eq!(t.usage(D0).used, 0);
    assert!(t.snapshot().processes.is_empty());
}

#[test]
fn compaction_keeps_live_slots_dense_and_writers_follow_their_slot() {
    let (p, t) = table("compact", 1000, 1000);
    let [a, b, c] = registered(&t);
    a.try_reserve(D0, UsageClass::Data, 1).unwrap();
    b.try_reserve(D0, UsageClass::Data, 2).unwrap();
    c.try_reserve(D0, UsageClass::Data, 4).unwrap();
    // The monitor tags c's HAMi slot (index 2) with a host pid.
    poke(
        &p,
        offsets::PROCS + 2 * offsets::PROC_SLOT_SIZE + 4,
        &4242i32.to_le_bytes(),
    );
    b.deregister().unwrap();
    c.try_reserve(D0, UsageClass::Data, 8).unwrap();
    let bytes = std::fs::read(&p.0).unwrap();
    let total_of = |k: usize| {
        read_u64(
            &bytes,
            offsets::PROCS + k * offsets::PROC_SLOT_SIZE + 8 + 32,
        )
    };
    assert_eq!(read_i32(&bytes, offsets::PROC_NUM), 2);
    assert_eq!(total_of(0), 1);
    assert_eq!(
        total_of(1),
        12,
        "c moved to index 1 and its new reservation landed there"
    );
    assert_eq!(total_of(2), 0, "no stale write to the old index");
    assert_eq!(
        read_i32(&bytes, offsets::PROCS + 2 * offsets::PROC_SLOT_SIZE),
        0
    );
    let snap = t.snapshot();
    let c_snap = snap.processes.iter().find(|p| p.slot == c.index()).unwrap();
    assert_eq!(c_snap.hami_index, 1);
    assert_eq!(
        c_snap.hostpid, 4242,
        "the monitor's hostpid moved with the slot"
    );
    assert_audit(&a, D0, 13);
}

#[test]
fn monitor_writes_are_honoured() {
    let (p, t) = table("monitor", 100, 100);
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 50).unwrap();
    poke(&p, offsets::LIMIT, &60u64.to_le_bytes()); // the monitor shrinks the limit
    assert!(me.try_reserve(D0, UsageClass::Data, 20).is_err());
    me.try_reserve(D0, UsageClass::Data, 10).unwrap();
    poke(&p, offsets::SM_LIMIT + 8, &25u64.to_le_bytes());
    assert_eq!(t.sm_limit(D1), Some(25));
    poke(&p, offsets::RECENT_KERNEL, &(-1i32).to_le_bytes());
    poke(&p, offsets::UTILIZATION_SWITCH, &1i32.to_le_bytes());
    assert_eq!(t.recent_kernel(), -1);
    assert_eq!(t.utilization_switch(), 1);
    me.release(D0, UsageClass::Data, 60);
}

#[test]
fn set_limits_on_a_live_file() {
    let (p, t) = table("setlimit", 100, 100);
    let me = t.register_self().unwrap();
    let cli = UsageTable::open_existing(&p.0).unwrap();
    cli.set_memory_limit(D0, Some(10)).unwrap();
    assert!(me.try_reserve(D0, UsageClass::Data, 11).is_err());
    cli.set_memory_limit(D0, None).unwrap();
    me.try_reserve(D0, UsageClass::Data, 1 << 40).unwrap();
    cli.set_sm_limit(D1, Some(50)).unwrap();
    assert_eq!(t.sm_limit(D1), Some(50));
    cli.set_priority(0).unwrap();
    assert_eq!(t.priority(), 0, "a priority change reaches the processes");
    assert!(matches!(
        cli.set_memory_limit(DeviceIndex(16), Some(1)),
        Err(ShmError::InvalidDevice { .. })
    ));
    assert!(matches!(
        cli.set_memory_limit(D0, Some(0)),
        Err(ShmError::InvalidValue { .. })
    ));
    assert!(matches!(
        cli.set_sm_limit(D0, Some(101)),
        Err(ShmError::InvalidValue { .. })
    ));
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    assert!(matches!(
        ro.set_memory_limit(D0, Some(1)),
        Err(ShmError::ReadOnly)
    ));
    assert!(matches!(ro.register_self(), Err(ShmError::ReadOnly)));
    let snap = ro.snapshot();
    assert_eq!(snap.devices[0].used, 1 << 40);
    assert!(snap.processes[0].alive);
    me.release(D0, UsageClass::Data, 1 << 40);
}

#[test]
fn hostpid_is_what_the_monitor_or_the_process_wrote() {
    let (_p, t) = table("hostpid", 1000, 2000);
    let me = t.register_self().unwrap();
    assert_eq!(me.hostpid(), None, "nobody wrote one");
    me.set_hostpid(4242);
    assert_eq!(me.hostpid(), Some(4242));
}

#[test]
fn a_charge_over_the_limit_shows_in_the_file_and_refuses_later_reservations() {
    let (_p, t) = table("overlimit", 1000, 2000);
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 900).unwrap();
    me.charge_over_limit(D0, UsageClass::Module, 300);
    assert_eq!(t.usage(D0).used, 1200);
    assert_eq!(me.held(D0).module, 300);
    assert!(me.try_reserve(D0, UsageClass::Data, 1).is_err());
    me.release(D0, UsageClass::Module, 300);
    assert_eq!(t.usage(D0).used, 900);
    assert!(me.audit(D0).unwrap().is_consistent());
}

#[test]
fn snapshot_reports_devices_and_processes() {
    let (_p, t) = table("snap", 1000, 2000);
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Context, 5).unwrap();
    me.try_reserve(D0, UsageClass::Module, 6).unwrap();
    me.try_reserve(D0, UsageClass::Data, 7).unwrap();
    me.set_sm_util(D0, 33);
    me.set_hostpid(777);
    let s = t.snapshot();
    assert_eq!(s.devices.len(), 2);
    let d = &s.devices[0];
    assert_eq!((d.used, d.context, d.module, d.data), (18, 5, 6, 7));
    assert_eq!(d.limit, Some(1000));
    assert_eq!(d.uuid, "GPU-aaaa");
    assert_eq!(s.devices[1].sm_limit, None);
    let pr = &s.processes[0];
    assert_eq!(pr.pid, std::process::id() as i32);
    assert_eq!(pr.hostpid, 777);
    assert!(pr.start_time > 0);
    assert_eq!(pr.devices[0].total(), 18);
    assert_eq!(pr.devices[0].sm_util, 33);
}

#[test]
fn crash_inside_a_device_lock_recovers_within_100ms() {
    use crate::protocol::Store;
    let (_p, t, [victim, other]) = first_of_two_holding("lockcrash", 30);
    // The victim dies inside reserve, after `total += 50` and before `held += 50`.
    {
        let st = t.store();
        st.lock_word(0).store(victim.owner_word(), Ordering::SeqCst);
        st.total(0).store(80, Ordering::SeqCst);
    }
    victim.simulate_death();
    let start = Instant::now();
    other.try_reserve(D0, UsageClass::Data, 90).unwrap(); // needs the dead usage back
    assert!(
        start.elapsed().as_millis() < 100,
        "recovery took {:?}",
        start.elapsed()
    );
    assert_eq!(t.usage(D0).used, 90);
    assert_audit(&other, D0, 90);
}

#[test]
fn administrator_killed_mid_repair_is_finished_by_the_next_reservation() {
    use crate::protocol::{Store, admin_owner_word};
    let (_p, t, [a, b]) = first_of_two_holding("admincrash", 30);
    b.try_reserve(D1, UsageClass::Data, 20).unwrap();
    // An administrator (a CLI, no slot of its own) died while rebuilding HAMi's view: device
    // lock 0 still names it, the view is half written, the dirty flag is set.
    {
        let st = t.store();
        let epoch = t.ext().header.admin_epoch.load(Ordering::SeqCst);
        st.lock_word(0)
            .store(admin_owner_word(epoch), Ordering::SeqCst);
        t.ext().header.admin_dirty.store(1, Ordering::SeqCst);
        t.region().proc_num.store(0, Ordering::SeqCst);
    }
    let start = Instant::now();
    b.try_reserve(D0, UsageClass::Data, 70).unwrap();
    assert!(
        start.elapsed().as_millis() < 100,
        "took {:?}",
        start.elapsed()
    );
    let snap = t.snapshot();
    assert_eq!(snap.proc_num, 2, "the view was rebuilt");
    assert_eq!(snap.devices[0].used, 100);
    assert_audit(&a, D0, 100);
    assert_audit(&a, D1, 20);
}

#[test]
fn full_slot_table_is_a_clear_error() {
    let (_p, t) = table("full", 100, 100);
    let mut slots = Vec::new();
    for _ in 0..MAX_SLOTS {
        slots.push(t.register_self().unwrap());
    }
    assert!(matches!(
        t.register_self(),
        Err(ShmError::TableFull { slots: 1024, .. })
    ));
    // One dies: its slot is found on the next registration.
    slots.pop().unwrap().simulate_death();
    let again = t.register_self().unwrap();
    assert_eq!(t.snapshot().proc_num, 1024);
    // Exiting 1,024 processes one by one is O(n²) probes; leak them instead (test only).
    std::mem::forget(again);
    for s in slots {
        std::mem::forget(s);
    }
}

#[test]
fn bad_files_get_typed_errors() {
    let p = TempPath::new("bad");
    let open = |bytes: &[u8]| {
        std::fs::write(&p.0, bytes).unwrap();
        match UsageTable::open_existing(&p.0) {
            Err(ShmError::InvalidFile { source, .. }) => source,
            other => panic!("expected InvalidFile, got {other:?}"),
        }
    };
    assert!(matches!(
        open(b"hello"),
        ImageError::Truncated { len: 5, .. }
    ));
    let mut junk = vec![0u8; FILE_LEN];
    junk[0..4].copy_from_slice(&1234u32.to_le_bytes());
    assert_eq!(open(&junk), ImageError::Foreign { flag: 1234 });
    let mut hami = vec![0u8; HAMI_FILE_LEN];
    hami[0..4].copy_from_slice(&19_920_718i32.to_le_bytes());
    hami[4..8].copy_from_slice(&1u32.to_le_bytes());
    hami[8..12].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(open(&hami), ImageError::HamiCoreFile);
    hami[8..12].copy_from_slice(&1u32.to_le_bytes());
    assert_eq!(
        open(&hami),
        ImageError::UnsupportedHamiVersion { major: 1, minor: 1 }
    );

    let good = {
        let q = TempPath::new("good");
        drop(UsageTable::open_or_create(&q.0, &init(1, 1)).unwrap());
        std::fs::read(&q.0).unwrap()
    };
    let mut newer = good.clone();
    newer[offsets::EXT_VERSION..offsets::EXT_VERSION + 4].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(
        open(&newer),
        ImageError::NewerVersion {
            found: 2,
            supported: 1
        }
    );
    let mut corrupt = good.clone();
    corrupt[offsets::DEVICE_NUM..offsets::DEVICE_NUM + 8].copy_from_slice(&99u64.to_le_bytes());
    assert_eq!(
        open(&corrupt),
        ImageError::Corrupt {
            field: "device_num",
            value: 99
        }
    );
    assert!(matches!(
        open(&good[..FILE_LEN - 1]),
        ImageError::Truncated { .. }
    ));
    // A zero-filled file of our size: open_existing says so; open_or_create initializes it
    // only if it carries vgpu's magic (see an_initialization_that_died_is_restarted_...), and
    // otherwise leaves it as it is (a_table_sized_file_that_is_not_a_table_is_left_alone).
    assert_eq!(open(&vec![0u8; FILE_LEN]), ImageError::Uninitialized);
    assert!(matches!(
        UsageTable::open_or_create(&p.0, &init(7, 7)),
        Err(ShmError::InvalidFile {
            source: ImageError::Uninitialized,
            ..
        })
    ));
    // Not a regular file.
    assert!(matches!(
        UsageTable::open_existing(std::env::temp_dir()),
        Err(ShmError::Io { .. })
    ));
}

/// A small deterministic generator (no extra dependency).
pub(crate) struct XorShift(pub u64);
impl XorShift {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn validate_image_never_panics_on_random_bytes() {
    let q = TempPath::new("fuzzbase");
    drop(UsageTable::open_or_create(&q.0, &init(1, 1)).unwrap());
    let good = std::fs::read(&q.0).unwrap();
    assert!(validate_image(&good).is_ok());
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..2000 {
        let len = (rng.next() % 4096) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let _ = validate_image(&bytes);
        // A good image with a few random header words patched.
        let mut img = good.clone();
        for _ in 0..(rng.next() % 4) {
            let hot = [
                0,
                4,
                8,
                56,
                layout::offsets::PROC_NUM,
                offsets::EXT_MAGIC,
                offsets::EXT_VERSION,
            ];
            let off = hot[(rng.next() % hot.len() as u64) as usize];
            img[off] = rng.next() as u8;
        }
        let _ = validate_image(&img);
    }
}

#[test]
fn attach_path_survives_random_file_contents() {
    let mut rng = XorShift(0x5eed_f00d_dead_beef);
    for round in 0..60 {
        let len = (rng.next() % 64) as usize * 5;
        let mut data: Vec<u8> = (0..len + 1).map(|_| rng.next() as u8).collect();
        if round % 2 == 0 {
            data[0] = b'P'; // patch a valid file
        }
        crate::fuzzing::attach_arbitrary(&data);
    }
    // Hot fields of a valid file, patched with extreme values.
    for off in [
        0u32, 4, 8, 56, 1600, 1728, 1856, 2_008_896, 2_009_024, 2_010_048,
    ] {
        for v in [0u8, 1, 0x7f, 0xff] {
            let mut data = vec![b'P'];
            for k in 0..8 {
                data.extend_from_slice(&(off + k).to_le_bytes());
                data.push(v);
            }
            crate::fuzzing::attach_arbitrary(&data);
        }
    }
}

/// A HAMi-core file image built at the byte offsets of docs hami-compat.md (literal numbers,
/// independent of the layout module, so a wrong offset there fails here).
fn hami_core_literal_image() -> Vec<u8> {
    let mut b = vec![0u8; 2_008_953];
    let put32 =
        |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put64 =
        |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    put32(&mut b, 0, 19_920_718);
    put32(&mut b, 4, 1);
    put32(&mut b, 8, 2);
    put64(&mut b, 56, 2);
    b[64..64 + 8].copy_from_slice(b"GPU-abcd");
    b[64 + 96..64 + 96 + 8].copy_from_slice(b"GPU-efgh");
    put64(&mut b, 1600, 4 << 30);
    put64(&mut b, 1728 + 8, 30);
    // Two slots: pid 100 running on device 0, pid 200 dead on device 1.
    for (j, pid, status, dev, ctx, data, sm) in [
        (
            0usize,
            100u32,
            1u32,
            0usize,
            300u64 << 20,
            1u64 << 30,
            40u64,
        ),
        (1, 200, 0, 1, 0, 512 << 20, 0),
    ] {
        let slot = 1856 + j * 1960;
        put32(&mut b, slot, pid);
        put32(&mut b, slot + 4, pid + 1000);
        let m = slot + 8 + dev * 64;
        put64(&mut b, m, ctx);
        put64(&mut b, m + 16, data);
        put64(&mut b, m + 32, ctx + data);
        put64(&mut b, slot + 1160 + dev * 48 + 16, sm);
        put32(&mut b, slot + 1928, status);
    }
    put32(&mut b, 2_008_896, 2);
    put32(&mut b, 2_008_908, 1);
    b
}

#[test]
fn a_hami_core_file_decodes_at_the_documented_offsets() {
    let s = crate::TableSnapshot::from_hami_core_image(&hami_core_literal_image()).unwrap();
    assert_eq!(s.devices.len(), 2);
    let d0 = &s.devices[0];
    assert_eq!(d0.uuid, "GPU-abcd");
    assert_eq!(d0.limit, Some(4 << 30));
    assert_eq!(
        (d0.context, d0.data, d0.used),
        (300 << 20, 1 << 30, (300 << 20) + (1 << 30))
    );
    assert_eq!(d0.sm_limit, None);
    let d1 = &s.devices[1];
    assert_eq!(
        (d1.limit, d1.sm_limit, d1.data),
        (None, Some(30), 512 << 20)
    );
    assert_eq!((s.proc_num, s.priority), (2, 1));
    assert_eq!(s.processes.len(), 2);
    let (p0, p1) = (&s.processes[0], &s.processes[1]);
    assert_eq!(
        (p0.pid, p0.hostpid, p0.alive, p0.suspended),
        (100, 1100, true, false)
    );
    assert_eq!(p0.devices[0].sm_util, 40);
    assert_eq!(p0.devices[0].total(), (300 << 20) + (1 << 30));
    assert_eq!((p1.pid, p1.alive, p1.slot), (200, false, 1));
    assert_eq!(p1.devices[0].total(), 0);
    assert_eq!(p1.devices[1].data, 512 << 20);
}

#[test]
fn a_hami_core_image_round_trips_and_is_refused_by_attach() {
    let mut s = crate::TableSnapshot::from_hami_core_image(&hami_core_literal_image()).unwrap();
    s.processes[0].suspended = true;
    s.last_kernel_time = 1234;
    let image = s.to_hami_core_image();
    assert_eq!(image.len(), HAMI_FILE_LEN);
    assert_eq!(crate::TableSnapshot::from_hami_core_image(&image), Ok(s));
    assert_eq!(validate_image(&image), Err(ImageError::HamiCoreFile));
    let p = TempPath::new("hami-core");
    std::fs::write(&p.0, &image).unwrap();
    let read = crate::TableSnapshot::read_hami_core_file(&p.0).unwrap();
    assert!(read.processes[0].suspended && read.processes[0].alive);
    assert_eq!(std::fs::read(&p.0).unwrap(), image, "reading never writes");
}

#[test]
fn other_files_are_refused_as_hami_core_files() {
    let decode = crate::TableSnapshot::from_hami_core_image;
    let short = decode(&[0u8; 100]).unwrap_err();
    assert_eq!(short, ImageError::ShortHamiRegion { len: 100 });
    assert!(short.to_string().contains("shorter"));
    let mut img = hami_core_literal_image();
    img[8] = 3;
    let newer = decode(&img).unwrap_err();
    assert!(newer.to_string().contains("version 1.3"), "{newer}");
    let mut img = hami_core_literal_image();
    img[0] = 0;
    assert!(matches!(decode(&img), Err(ImageError::Foreign { .. })));
    // A proc_num beyond the slot count is clamped, not trusted.
    let mut img = hami_core_literal_image();
    img[2_008_896..2_008_900].copy_from_slice(&i32::MAX.to_le_bytes());
    assert_eq!(decode(&img).unwrap().processes.len(), 2);
    let missing = crate::TableSnapshot::read_hami_core_file("/nonexistent/vgpu-x.cache");
    assert!(matches!(missing, Err(ShmError::Io { op: "read", .. })));
}

/// `leave` while another thread keeps reserving and releasing through the same handle: the
/// usage is gone from the file at once (a read-only reader, which never sweeps, sees no slot
/// and no usage), later reservations are refused, releases change nothing, and a peer's usage
/// is untouched.
#[test]
fn leave_gives_usage_back_at_once_while_another_thread_reserves() {
    let (p, t) = table("leave", 1 << 30, 1 << 30);
    let peer = t.register_self().unwrap();
    peer.try_reserve(D0, UsageClass::Data, 1000).unwrap();
    let me = std::sync::Arc::new(t.register_self().unwrap());
    me.try_reserve(D0, UsageClass::Data, 5 << 20).unwrap();
    me.try_reserve(D1, UsageClass::Context, 7).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let (me, stop) = (me.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut granted, mut refused) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                match me.try_reserve(D0, UsageClass::Data, 4096) {
                    Ok(()) => {
                        granted += 1;
                        me.release(D0, UsageClass::Data, 4096);
                    }
                    Err(_) => refused += 1,
                }
            }
            (granted, refused)
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    me.leave().unwrap();
    assert!(me.has_left());
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    let snap = ro.snapshot();
    assert_eq!(
        snap.processes.len(),
        1,
        "only the peer: {:?}",
        snap.processes
    );
    assert_eq!(snap.processes[0].slot, peer.index());
    assert_eq!(snap.proc_num, 1);
    assert_eq!(snap.devices[0].used, 1000);
    assert_eq!(snap.devices[1].used, 0);
    std::thread::sleep(std::time::Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    let (granted, refused) = worker.join().unwrap();
    assert!(granted > 0 && refused > 0, "{granted} {refused}");
    assert_eq!(
        ro.snapshot().devices[0].used,
        1000,
        "nothing charged after leaving"
    );
    assert!(me.try_reserve(D0, UsageClass::Data, 1).is_err());
    me.release(D0, UsageClass::Data, 1000); // not ours: must not touch the peer's
    assert_eq!(peer.audit(D0).unwrap().total, 1000);
    assert!(peer.audit(D0).unwrap().is_consistent());
    me.leave().unwrap(); // idempotent
    // The slot is free for the next process.
    let next = t.register_self().unwrap();
    next.try_reserve(D0, UsageClass::Data, 1).unwrap();
    assert_eq!(ro.snapshot().devices[0].used, 1001);
}

/// Kernel activity marks `recent_kernel = 2` like HAMi-core, but never overwrites the
/// monitor's negative "block" value, and a read-only handle writes nothing.
#[test]
fn kernel_activity_marks_recent_kernel_but_never_a_negative_value() {
    let (p, t) = table("recent", 100, 100);
    let rk = |v: i32| poke(&p, offsets::RECENT_KERNEL, &v.to_le_bytes());
    assert_eq!((t.recent_kernel(), t.last_kernel_time()), (0, 0));
    t.note_kernel_activity();
    assert_eq!(t.recent_kernel(), crate::RECENT_KERNEL_ACTIVE);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(t.last_kernel_time().abs_diff(now) <= 2);
    for (before, after) in [
        (1, 2),
        (0, 2),
        (7, 2),
        (-1, -1),
        (-5, -5),
        (i32::MIN, i32::MIN),
    ] {
        rk(before);
        t.note_kernel_activity();
        assert_eq!(t.recent_kernel(), after, "from {before}");
    }
    rk(0);
    UsageTable::open_read_only(&p.0)
        .unwrap()
        .note_kernel_activity();
    assert_eq!(t.recent_kernel(), 0, "a read-only handle writes nothing");
}

/// `sm_util` publish times: per slot and device, read back by any handle; an untimed report
/// clears the time; a new process in a reused slot starts without one.
#[test]
fn sm_util_publish_times_belong_to_the_slots_current_process() {
    let (p, t) = table("times", 100, 100);
    let b = std::fs::read(&p.0).unwrap();
    assert_eq!(b.len(), FILE_LEN);
    assert_eq!(
        read_i32(&b, offsets::EXT_MINOR_VERSION),
        layout::EXT_MINOR as i32
    );
    // The base an older library checks is unchanged: version 1, its extension size.
    assert_eq!(read_i32(&b, offsets::EXT_VERSION), 1);
    assert_eq!(
        read_i32(&b, offsets::EXT_SIZE) as usize,
        layout::BASE_FILE_LEN - layout::EXT_OFFSET
    );
    let a = t.register_self().unwrap();
    a.publish_sm_util(D0, 40, 123_456_789);
    a.publish_sm_util(D1, 7, 5);
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    let pa = &ro.snapshot().processes[0];
    assert_eq!(pa.devices[0].sm_util, 40);
    assert_eq!(pa.devices[0].sm_util_at, Some(123_456_789));
    assert_eq!(pa.devices[1].sm_util_at, Some(5));
    assert_eq!(a.held(D0).sm_util_at, Some(123_456_789));
    a.set_sm_util(D1, 9); // no time: none is claimed
    assert_eq!(ro.snapshot().processes[0].devices[1].sm_util_at, None);
    let slot = a.index();
    a.leave().unwrap();
    let c = t.register_self().unwrap();
    assert_eq!(c.index(), slot, "the freed slot is reused");
    let pc = &ro.snapshot().processes[0];
    assert_eq!((pc.devices[0].sm_util, pc.devices[0].sm_util_at), (0, None));
    // A process of an older library (it writes no times) in a slot whose previous owner left
    // times: those times are not its own.
    c.publish_sm_util(D0, 30, 99);
    let ident = &t.ext().slots[slot].ident;
    let (generation, state) = crate::protocol::split_ident(ident.load(Ordering::SeqCst));
    ident.store(
        crate::protocol::ident_word(generation + 1, state),
        Ordering::SeqCst,
    );
    assert_eq!(ro.snapshot().processes[0].devices[0].sm_util_at, None);
    ident.store(
        crate::protocol::ident_word(generation, state),
        Ordering::SeqCst,
    );
}

/// A file written before the publish-time table existed (extension minor version 0, the base
/// length) is upgraded in place by the first writable open, keeping limits, slots and usage;
/// a read-only open reads it as it is.
#[test]
fn a_minor_0_file_is_upgraded_in_place() {
    let (p, t) = table("minor0", 1000, 2000);
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 300).unwrap();
    me.set_sm_util(D0, 12);
    // Make it what an older library writes: minor 0, base length, garbage after the base
    // would be cut off anyway.
    poke(&p, offsets::EXT_MINOR_VERSION, &0u32.to_le_bytes());
    cut_to(&p, layout::BASE_FILE_LEN);
    let b = std::fs::read(&p.0).unwrap();
    assert_eq!(validate_image(&b).unwrap().minor_version, 0);
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    let snap = ro.snapshot();
    assert_eq!(snap.devices[0].used, 300);
    assert_eq!(snap.processes[0].devices[0].sm_util, 12);
    assert_eq!(snap.processes[0].devices[0].sm_util_at, None);
    assert_eq!(
        std::fs::metadata(&p.0).unwrap().len(),
        layout::BASE_FILE_LEN as u64
    );
    // A writable open appends the table.
    let (again, _) = upgraded(&p, layout::EXT_MINOR);
    assert_eq!(again.memory_limit(D1), Some(2000));
    let other = again.register_self().unwrap();
    other.publish_sm_util(D0, 20, 777);
    let snap = again.snapshot();
    assert_eq!(snap.devices[0].used, 300, "usage kept");
    let po = snap
        .processes
        .iter()
        .find(|p| p.slot == other.index())
        .unwrap();
    assert_eq!(po.devices[0].sm_util_at, Some(777));
    // The earlier process wrote no time since the upgrade: its share has none.
    let pm = snap
        .processes
        .iter()
        .find(|p| p.slot == me.index())
        .unwrap();
    assert_eq!(
        (pm.devices[0].sm_util, pm.devices[0].sm_util_at),
        (12, None)
    );
    // A minor-1 file cut short is refused, not read past its end.
    cut_to(&p, FILE_LEN - 64);
    assert_cut_short(&p);
}

// --- files a vgpu table may be written into (issue 12, defect 4) and its link (defect 8) ---

#[test]
fn a_symlink_at_the_path_is_refused_and_its_target_untouched() {
    // The target: an empty private file of someone else's (here: the test's).
    let target = TempPath::new("link-target");
    std::fs::write(&target.0, b"").unwrap();
    std::fs::set_permissions(&target.0, std::fs::Permissions::from_mode(0o600)).unwrap();
    let p = TempPath::new("link");
    std::os::unix::fs::symlink(&target.0, &p.0).unwrap();
    for open in [
        UsageTable::open_or_create(&p.0, &init(1, 1)),
        UsageTable::open_existing(&p.0),
        UsageTable::open_read_only(&p.0),
    ] {
        match open {
            Err(ShmError::Refused { reason, .. }) => {
                assert!(reason.contains("symbolic link"), "{reason}")
            }
            other => panic!("expected Refused, got {other:?}"),
        }
    }
    assert_eq!(
        std::fs::metadata(&target.0).unwrap().len(),
        0,
        "nothing written"
    );
}

#[test]
fn a_table_sized_file_that_is_not_a_table_is_left_alone() {
    // First word zero, data after it: not vgpu's (no extension magic), so never rewritten.
    let p = TempPath::new("zero-first");
    let mut data = vec![0u8; FILE_LEN];
    for (i, b) in data.iter_mut().enumerate().skip(8) {
        *b = (i % 251) as u8;
    }
    data[offsets::EXT_MAGIC..offsets::EXT_MAGIC + 8].fill(0);
    std::fs::write(&p.0, &data).unwrap();
    match UsageTable::open_or_create(&p.0, &init(7, 7)) {
        Err(ShmError::InvalidFile {
            source: ImageError::Uninitialized,
            ..
        }) => {}
        other => panic!("expected Uninitialized, got {other:?}"),
    }
    assert!(
        std::fs::read(&p.0).unwrap() == data,
        "the file's data is kept"
    );
}

#[test]
fn an_initialization_that_died_is_restarted_because_it_carries_vgpus_magic() {
    // What an initializer killed after its first store leaves: our magic, no HAMi flag.
    let p = TempPath::new("init-died");
    let mut data = vec![0u8; FILE_LEN];
    data[offsets::EXT_MAGIC..offsets::EXT_MAGIC + 8]
        .copy_from_slice(&layout::EXT_MAGIC.to_le_bytes());
    data[offsets::DEVICE_NUM] = 0xee; // half-written junk, zero-filled again
    std::fs::write(&p.0, &data).unwrap();
    let t = UsageTable::open_or_create(&p.0, &init(7, 8)).unwrap();
    assert!(t.created());
    assert_eq!((t.memory_limit(D0), t.memory_limit(D1)), (Some(7), Some(8)));
    assert_eq!(t.device_num(), 2);
}

#[test]
fn an_empty_file_is_adopted_only_when_it_has_one_name() {
    // One name: made beforehand (an operator's mode and group) or its creator died at once.
    let p = TempPath::new("empty-one");
    std::fs::write(&p.0, b"").unwrap();
    std::fs::set_permissions(&p.0, std::fs::Permissions::from_mode(0o640)).unwrap();
    let t = UsageTable::open_or_create(&p.0, &init(5, 5)).unwrap();
    assert!(t.created());
    let m = std::fs::metadata(&p.0).unwrap();
    assert_eq!(m.permissions().mode() & 0o777, 0o640, "its mode is kept");
    // Two names: a hard link to somebody's empty file. Left alone.
    let other = TempPath::new("empty-other");
    std::fs::write(&other.0, b"").unwrap();
    let q = TempPath::new("empty-two");
    std::fs::hard_link(&other.0, &q.0).unwrap();
    match UsageTable::open_or_create(&q.0, &init(5, 5)) {
        Err(ShmError::Refused { reason, .. }) => assert!(reason.contains("2 names"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(std::fs::metadata(&other.0).unwrap().len(), 0);
}

#[test]
fn a_foreign_owned_file_in_a_world_writable_directory_is_refused() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("vgpu-shm-ww-{}", std::process::id()));
    // Fresh: a killed run of the same pid may have left a stranger's file in it.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let p = TempPath(dir.join("c.cache"));
    drop(UsageTable::open_or_create(&p.0, &init(1, 1)).unwrap());
    let me = std::fs::metadata(&p.0).unwrap().uid();
    // Another user's file (only root can make one here; skipped otherwise).
    let stranger = 54_321u32;
    let chowned = std::process::Command::new("chown")
        .arg(stranger.to_string())
        .arg(&p.0)
        .status()
        .is_ok_and(|s| s.success());
    if !chowned || me == stranger {
        eprintln!("skipped: cannot give the file to another user");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    match UsageTable::open_existing(&p.0) {
        Err(ShmError::Refused { reason, .. }) => assert!(reason.contains("uid 54321"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(
        UsageTable::open_read_only(&p.0).is_ok(),
        "reading is harmless"
    );
    // The same file in a directory only its users can write is theirs to share.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(UsageTable::open_existing(&p.0).is_ok());
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_table_knows_when_its_path_no_longer_names_its_file() {
    use crate::FileLink;
    let (p, t) = table("linked", 1000, 1000);
    let me = t.register_self().unwrap();
    assert_eq!(t.link_state().unwrap(), FileLink::Linked);
    std::fs::remove_file(&p.0).unwrap();
    assert_eq!(t.link_state().unwrap(), FileLink::Unlinked);
    // A newcomer creates a second file under the name: two ledgers, each under the limit.
    let newcomer = UsageTable::open_or_create(&p.0, &init(1000, 1000)).unwrap();
    assert_eq!(t.link_state().unwrap(), FileLink::Replaced);
    assert_eq!(newcomer.link_state().unwrap(), FileLink::Linked);
    me.try_reserve(D0, UsageClass::Data, 800).unwrap();
    let other = newcomer.register_self().unwrap();
    other.try_reserve(D0, UsageClass::Data, 800).unwrap();
    // A link put in its place is a replacement too.
    std::fs::remove_file(&p.0).unwrap();
    std::os::unix::fs::symlink("/dev/null", &p.0).unwrap();
    assert_eq!(newcomer.link_state().unwrap(), FileLink::Replaced);
}

// --- the host-backed class (issue 16) ---

/// The host policy is the creator's, on every device, from the moment the file is visible;
/// a process opening it later with another keeps the file's (as with the limits).
#[test]
fn a_new_file_has_its_creator_s_host_policy_and_keeps_it() {
    let p = TempPath::new("hostpolicy");
    let made_with = crate::HostPolicy {
        spill: 64 << 20,
        oversubscribe: true,
    };
    let t =
        UsageTable::open_or_create_with_host_policy(&p.0, &init(1000, 2000), made_with).unwrap();
    assert!(t.created());
    for d in 0..layout::MAX_DEVICES as u32 {
        assert_eq!(t.host_policy(DeviceIndex(d)), made_with, "device {d}");
    }
    let other = crate::HostPolicy {
        spill: 10 << 30,
        oversubscribe: false,
    };
    let joined = UsageTable::open_or_create_with_host_policy(&p.0, &init(1, 1), other).unwrap();
    assert!(!joined.created());
    assert_eq!(joined.host_policy(D1), made_with);
    assert_eq!(
        UsageTable::open_or_create(&p.0, &init(1, 1))
            .unwrap()
            .host_policy(D0),
        made_with
    );
}

/// Host-backed bytes are their own class: in the extension (snapshot, node-side reader), not
/// in the device's `used` nor in HAMi's fields (the monitor reads device memory only); the
/// policy is the file's and bounds them.
#[test]
fn host_backed_bytes_are_their_own_class_and_not_in_hamis_fields() {
    let p = TempPath::new("host");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    let me = t.register_self().unwrap();
    assert!(me.try_reserve_host(D0, 1).is_err(), "off by default");
    let spill = crate::HostPolicy {
        spill: 500,
        oversubscribe: false,
    };
    t.set_host_policy(D0, spill).unwrap();
    assert_eq!(t.host_policy(D0), spill);
    me.try_reserve(D0, UsageClass::Data, 1000).unwrap();
    me.try_reserve_host(D0, 400).unwrap();
    assert!(me.try_reserve_host(D0, 101).is_err());
    assert_eq!(me.held(D0).host, 400);
    assert_eq!(t.host_used(D0), 400);
    assert_eq!(me.held(D0).total(), 1000);
    let snap = t.snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].host), (1000, 400));
    assert_eq!(snap.devices[0].host_policy, spill);
    assert_eq!(snap.processes[0].devices[0].host, 400);
    let node = crate::NodeReader::default().table(&p.0).unwrap();
    assert_eq!(node.devices[0].host, 400);
    assert_eq!(node.processes[0].devices[0].host, 400);
    // HAMi's mirror: device memory only.
    let b = std::fs::read(&p.0).unwrap();
    let used = offsets::slot(0) + offsets::slot_memory(0);
    assert_eq!(read_u64(&b, used + offsets::MEMORY_TOTAL), 1000);
    let audit = me.audit(D0).unwrap();
    assert!(audit.is_consistent(), "{audit:?}");
    assert_eq!((audit.host_total, audit.host_held), (400, 400));
    // A move: device room first (refused here: the limit is full), then the host bytes go.
    assert!(me.try_reserve_move(D0, 400).is_err());
    me.release(D0, UsageClass::Data, 400);
    me.try_reserve_move(D0, 400).unwrap();
    me.release_host(D0, 400);
    let snap = t.snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].host), (1000, 0));
    // Leaving gives host bytes back too.
    me.try_reserve_host(D0, 100).unwrap();
    me.leave().unwrap();
    assert_eq!(t.snapshot().devices[0].host, 0);
}

/// A minor-1 file (an older library's: no host class) is upgraded in place by the first
/// writable open; a read-only open reads it with no host bytes and host backing off.
#[test]
fn a_minor_1_file_gains_the_host_class_in_place() {
    let p = TempPath::new("minor1");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 300).unwrap();
    drop(t);
    poke(&p, offsets::EXT_MINOR_VERSION, &1u32.to_le_bytes());
    // Garbage where the host words will be: an upgrade must not take it for usage.
    poke(&p, layout::HOST_OFFSET, &77u64.to_le_bytes());
    let host_total = layout::EXT_OFFSET + 64 + 16;
    poke(&p, host_total, &55u64.to_le_bytes());
    cut_to(&p, layout::MINOR1_FILE_LEN);
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    let snap = ro.snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].host), (300, 0));
    assert_eq!(snap.devices[0].host_policy, crate::HostPolicy::default());
    let (again, b) = upgraded(&p, layout::EXT_MINOR);
    assert_eq!(read_u64(&b, layout::HOST_OFFSET), 0);
    assert_eq!(read_u64(&b, host_total), 0);
    let snap = again.snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].host), (300, 0));
    // A minor-2 file cut before the host class is refused.
    drop((again, ro, me));
    cut_to(&p, layout::MINOR1_FILE_LEN);
    assert_cut_short(&p);
}

#[test]
fn refusals_are_counted_per_device_and_shown_in_the_snapshot() {
    let p = TempPath::new("refusals");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    t.count_refusal(D1);
    t.count_refusal(D1);
    t.count_refusal(DeviceIndex(99)); // out of range: ignored, no panic
    let snap = t.snapshot();
    assert_eq!(
        (snap.devices[0].oom_refusals, snap.devices[1].oom_refusals),
        (0, 2)
    );
    let b = std::fs::read(&p.0).unwrap();
    assert_eq!(
        read_u64(&b, offsets::DEVICE_OOM_REFUSALS + offsets::DEVICE_STRIDE),
        2
    );
    // The node side (a private copy, never mapped) sees the same count.
    let node = crate::NodeReader::default().table(&p.0).unwrap();
    assert_eq!(node.devices[1].oom_refusals, 2);
}

#[test]
fn a_minor_2_file_gains_the_refusal_counts_in_place() {
    let p = TempPath::new("minor2");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    t.set_host_policy(
        D0,
        crate::HostPolicy {
            spill: 500,
            oversubscribe: false,
        },
    )
    .unwrap();
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 300).unwrap();
    me.try_reserve_host(D0, 200).unwrap();
    drop(t);
    poke(&p, offsets::EXT_MINOR_VERSION, &2u32.to_le_bytes());
    // Garbage where the count will be: a reader must not take it for refusals.
    poke(&p, offsets::DEVICE_OOM_REFUSALS, &77u64.to_le_bytes());
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    assert_eq!(ro.snapshot().devices[0].oom_refusals, 0);
    ro.count_refusal(D0); // a minor-2 view counts nothing
    let (again, b) = upgraded(&p, layout::EXT_MINOR);
    assert_eq!(read_u64(&b, offsets::DEVICE_OOM_REFUSALS), 0);
    let snap = again.snapshot();
    // The minor-2 parts survive the upgrade: the host class and its policy were live.
    assert_eq!(
        (
            snap.devices[0].used,
            snap.devices[0].host,
            snap.devices[0].oom_refusals
        ),
        (300, 200, 0)
    );
    assert_eq!(snap.devices[0].host_policy.spill, 500);
    again.count_refusal(D0);
    assert_eq!(again.snapshot().devices[0].oom_refusals, 1);
    drop((again, ro, me));
}

/// A minor-3 file (an older library's: no swap-out requests, no swapped slots) is upgraded in
/// place: what was padding there reads as zero, whatever it held, and only then counts.
#[test]
fn a_minor_3_file_gains_the_swap_words_in_place() {
    let p = TempPath::new("minor3");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 300).unwrap();
    drop(t);
    poke(&p, offsets::EXT_MINOR_VERSION, &3u32.to_le_bytes());
    poke(&p, offsets::EXT_SWAP_REQUESTS, &9u32.to_le_bytes());
    poke(&p, offsets::SLOT_SWAPPED_OUT, &1u32.to_le_bytes());
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    assert_eq!(ro.swap_requests(), 0, "padding is no request");
    assert!(
        !ro.snapshot().processes[0].swapped_out,
        "padding is no swapped process"
    );
    assert_eq!(ro.request_swap_out(), None, "a read-only view asks nothing");
    let (again, b) = upgraded(&p, layout::EXT_MINOR);
    assert_eq!(read_i32(&b, offsets::EXT_SWAP_REQUESTS), 0);
    assert_eq!(read_i32(&b, offsets::SLOT_SWAPPED_OUT), 0);
    let snap = again.snapshot();
    assert_eq!(snap.devices[0].used, 300, "the minor-3 parts survive");
    assert!(!snap.processes[0].swapped_out);
    assert_eq!(again.request_swap_out(), Some(0));
    assert_eq!(again.swap_requests(), 1);
    drop((again, ro, me));
}

/// A swap-out moves bytes from the data class to the host class with no bound (they are the
/// process's already), and the slot's word says so until the slot is claimed again.
#[test]
fn a_swap_out_charge_moves_between_classes_and_a_new_process_is_not_swapped() {
    let p = TempPath::new("swapcharge");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 600).unwrap();
    // Host backing off in this file: a host reservation is refused, a swap-out's is not.
    assert!(me.try_reserve_host(D0, 600).is_err());
    me.reserve_swap_out(D0, 600).unwrap();
    me.release(D0, UsageClass::Data, 600);
    me.set_swapped_out(true);
    let snap = t.snapshot();
    assert_eq!((snap.devices[0].used, snap.devices[0].host), (0, 600));
    assert!(snap.processes[0].swapped_out);
    let index = me.index();
    drop(me);
    // The slot freed (its usage swept with it) and taken again: not swapped out.
    let next = t.register_self().unwrap();
    assert_eq!(next.index(), index);
    let snap = t.snapshot();
    assert!(!snap.processes[0].swapped_out);
    assert_eq!((snap.devices[0].used, snap.devices[0].host), (0, 0));
    drop(next);
}

/// A minor-4 file (an older library's: its processes say nothing of the host memory they
/// keep for swap-outs) is upgraded in place: the record padding where the kept bytes go reads
/// as nobody saying anything, whatever it held (even a stamp naming the live process), and
/// the counts of minors 3 and 4 survive the upgrade.
#[test]
fn a_minor_4_file_gains_the_kept_host_words_in_place() {
    let p = TempPath::new("minor4");
    let t = UsageTable::open_or_create(&p.0, &init(1000, 2000)).unwrap();
    let me = t.register_self().unwrap();
    me.try_reserve(D0, UsageClass::Data, 300).unwrap();
    t.count_refusal(D0);
    assert_eq!(t.request_swap_out(), Some(0));
    let ident = t.ext().slots[me.index()].ident.load(Ordering::SeqCst);
    drop(t);
    poke(&p, offsets::EXT_MINOR_VERSION, &4u32.to_le_bytes());
    let slot = me.index() * offsets::SLOT_STRIDE;
    poke(&p, offsets::SLOT_KEPT_IDENT + slot, &ident.to_le_bytes());
    poke(&p, offsets::SLOT_KEPT_HOST + slot, &77u64.to_le_bytes());
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    let snap = ro.snapshot();
    assert_eq!(
        (snap.kept_host, snap.processes[0].kept_host),
        (None, None),
        "a minor-4 file says nothing of kept memory"
    );
    let (again, b) = upgraded(&p, layout::EXT_MINOR);
    assert_eq!(read_u64(&b, offsets::SLOT_KEPT_IDENT + slot), 0);
    assert_eq!(read_u64(&b, offsets::SLOT_KEPT_HOST + slot), 0);
    let snap = again.snapshot();
    // The file says now (nothing kept); the process already there, an older library's in
    // the upgraded file, still does not.
    assert_eq!(
        (snap.kept_host, snap.processes[0].kept_host),
        (Some(0), None)
    );
    assert_eq!(snap.devices[0].used, 300, "the minor-4 parts survive");
    assert_eq!(snap.devices[0].oom_refusals, 1, "a count is not padding");
    assert_eq!(again.swap_requests(), 1);
    drop((again, ro, me));
}

/// The kept host bytes are the slot's process's own: they add and subtract exactly (never
/// below 0), a dead process's read as 0 (its pinned memory went with it), a new process in
/// the slot starts at 0, and a process of an older library (which never stamps the slot)
/// says nothing rather than its predecessor's figure.
#[test]
fn kept_host_bytes_belong_to_the_slots_process() {
    let (p, t) = table("kept", 1000, 2000);
    let [a, b]: [ProcessSlot; 2] = registered(&t);
    let kept = |s: &crate::TableSnapshot| -> Vec<Option<u64>> {
        s.processes.iter().map(|p| p.kept_host).collect()
    };
    a.add_kept_host(300);
    a.remove_kept_host(100);
    b.add_kept_host(50);
    let snap = t.snapshot();
    assert_eq!(kept(&snap), [Some(200), Some(50)]);
    assert_eq!(snap.kept_host, Some(250));
    let bytes = std::fs::read(&p.0).unwrap();
    let at = offsets::SLOT_KEPT_HOST + a.index() * offsets::SLOT_STRIDE;
    assert_eq!(read_u64(&bytes, at), 200, "at its documented offset");
    b.remove_kept_host(80);
    assert_eq!(b.kept_host(), 0, "never below zero");
    let ro = UsageTable::open_read_only(&p.0).unwrap();
    assert_eq!(ro.snapshot().kept_host, Some(200));
    let index = a.index();
    a.simulate_death();
    let snap = ro.snapshot(); // a read-only view does not sweep: the dead slot is listed
    assert_eq!(kept(&snap), [Some(0), Some(0)], "{snap:?}");
    assert!(!snap.processes[0].alive);
    assert_eq!(t.sweep_dead().unwrap(), 1);
    let c = t.register_self().unwrap();
    assert_eq!(c.index(), index, "the freed slot is reused");
    assert_eq!(c.kept_host(), 0, "a new process keeps nothing yet");
    c.add_kept_host(10);
    assert_eq!(ro.snapshot().kept_host, Some(10));
    // A process of an older library in the slot: a new ident, no stamp of its own.
    let ident = &t.ext().slots[index].ident;
    let (generation, state) = crate::protocol::split_ident(ident.load(Ordering::SeqCst));
    ident.store(
        crate::protocol::ident_word(generation + 1, state),
        Ordering::SeqCst,
    );
    let snap = ro.snapshot();
    let older = snap.processes.iter().find(|p| p.slot == index).unwrap();
    assert_eq!(older.kept_host, None);
    assert_eq!(snap.kept_host, Some(0));
    ident.store(
        crate::protocol::ident_word(generation, state),
        Ordering::SeqCst,
    );
    drop((b, c));
}
