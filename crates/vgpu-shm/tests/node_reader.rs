//! A tenant truncating and restoring its own usage file while node-side readers read it:
//! a mapped reader dies of SIGBUS, a [`NodeReader`] never does (issue 12, defect 3).

mod common;

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
use vgpu_shm::{NodeReader, TableInit, UsageTable};

const SIGBUS_EXIT: i32 = 128 + libc::SIGBUS;

fn init() -> TableInit {
    one_gpu("GPU-trunc", 1 << 30)
}

#[test]
fn truncating_the_file_kills_a_mapped_reader_but_never_a_node_reader() {
    let path = TempPath::new("nodereader");
    let (_table, me) = join(&path, &init());
    me.try_reserve(DeviceIndex(0), UsageClass::Data, 4096)
        .unwrap();
    let image = std::fs::read(&path.0).unwrap();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path.0)
        .unwrap();

    // The control: a reader that maps the file, which then shrinks, faults at once.
    let mapped = fork_child(|| {
        let ro = UsageTable::open_read_only(&path.0).unwrap();
        file.set_len(4096).unwrap();
        let _ = ro.snapshot();
        0
    });
    assert_eq!(wait(mapped), SIGBUS_EXIT, "a mapped reader dies of SIGBUS");
    file.write_all_at(&image, 0).unwrap();

    // [0]: reads done, [1]: of which succeeded, [2]: stop.
    let ctl = Control::new(3);
    let reader = fork_child(|| {
        let node = NodeReader::new(Duration::from_secs(5));
        while ctl.word(2).load(Ordering::SeqCst) == 0 {
            if let Ok(snap) = node.table(&path.0) {
                assert_eq!(snap.devices[0].limit, Some(1 << 30));
                ctl.word(1).fetch_add(1, Ordering::SeqCst);
            }
            ctl.word(0).fetch_add(1, Ordering::SeqCst);
        }
        0
    });
    let mut flips = 0u64;
    while load(ctl.word(0)) < 400 && flips < 200_000 {
        file.set_len(flips % 3 * 1_000_000).unwrap();
        std::thread::yield_now();
        file.write_all_at(&image, 0).unwrap();
        if flips % 2 == 0 {
            // Whole for a while, so that reads succeed too.
            std::thread::sleep(Duration::from_micros(300));
        }
        flips += 1;
    }
    ctl.word(2).store(1, Ordering::SeqCst);
    assert_eq!(
        wait(reader),
        0,
        "the node reader survived {flips} truncations"
    );
    let (reads, ok) = (load(ctl.word(0)), load(ctl.word(1)));
    assert!(reads >= 400, "{reads} reads");
    eprintln!("{ok} of {reads} reads saw a whole file, {flips} truncations");
    assert!(ok > 0, "{ok} of {reads} reads saw a whole file");
}
