//! The attach path over arbitrary file contents, for the `shm_attach` fuzz target and tests.

use std::sync::atomic::{AtomicU64, Ordering};

use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};

use crate::layout::FILE_LEN;
use crate::{TableInit, UsageTable, validate_image};

/// Write `data` as a table file and use it the way the hook and the CLI do: validate (also as
/// a HAMi-core-written file), attach, register, reserve, release, set limits, sweep, snapshot.
/// Must never panic, hang or exit, whatever the bytes.
///
/// If `data` starts with `b'P'`, the rest is a list of patches `(offset: u32 LE, byte)` applied
/// to a freshly initialized valid file, which reaches the code behind validation; otherwise
/// `data` is the whole file.
pub fn attach_arbitrary(data: &[u8]) {
    let _ = validate_image(data);
    let _ = crate::TableSnapshot::from_hami_core_image(data);
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!(
        "vgpu-fuzz-{}-{}.cache",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let init = TableInit {
        uuids: vec!["GPU-fuzz".into()],
        memory_limits: vec![Some(1 << 20)],
        sm_limits: vec![Some(50)],
        priority: 1,
    };
    let bytes = if let Some(patches) = data.strip_prefix(b"P") {
        let _ = std::fs::remove_file(&path);
        if UsageTable::open_or_create(&path, &init).is_err() {
            return;
        }
        let mut image = std::fs::read(&path).unwrap_or_default();
        for p in patches.chunks_exact(5) {
            let off = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize % FILE_LEN;
            if let Some(b) = image.get_mut(off) {
                *b = p[4];
            }
        }
        image
    } else {
        data.to_vec()
    };
    if std::fs::write(&path, &bytes).is_ok() {
        exercise(&path, &init);
    }
    let _ = std::fs::remove_file(&path);
}

fn exercise(path: &std::path::Path, init: &TableInit) {
    let _ = validate_image(&std::fs::read(path).unwrap_or_default());
    if let Ok(ro) = UsageTable::open_read_only(path) {
        let _ = ro.snapshot();
    }
    let Ok(table) = UsageTable::open_or_create(path, init) else {
        return;
    };
    let _ = table.snapshot();
    let _ = table.sweep_dead();
    if let Ok(me) = table.register_self() {
        for d in [0u32, 1, 15, 16] {
            let d = DeviceIndex(d);
            for class in [UsageClass::Context, UsageClass::Module, UsageClass::Data] {
                if me.try_reserve(d, class, 4096).is_ok() {
                    me.release(d, class, 4096);
                }
            }
            let _ = me.audit(d);
            me.set_sm_util(d, 10);
        }
        let _ = table.set_memory_limit(DeviceIndex(0), Some(1 << 30));
        let _ = table.set_sm_limit(DeviceIndex(0), Some(100));
        let _ = table.snapshot();
        let _ = me.deregister();
    }
    let _ = (
        table.recent_kernel(),
        table.utilization_switch(),
        table.priority(),
        table.device_num(),
    );
}
